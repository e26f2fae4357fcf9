//! Waking idle workers on PostgreSQL: one `LISTEN outbox_event` connection per repository
//! (its clones share it), started on the first wait, reconnecting while the pool is open. A
//! statement-level trigger notifies on enqueue.
//!
//! `LISTEN` needs a session of its own. On a direct pool the listener takes a connection of
//! the pool; behind a transaction pooler it connects to [`super::PgSettings::listen_url`] (a
//! direct URL of the server), and without one there is no listener: idle workers poll at
//! their poll interval.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::{Notify, OnceCell};

use super::{NOTIFY_CHANNEL, PgOutbox, Pooler};

/// What the listener shares with the repository's clones.
#[derive(Debug, Default)]
pub(super) struct Wake {
    /// Notified on every notification, and once each time a listener starts listening.
    pub(super) notify: Notify,
    listener: OnceCell<()>,
}

impl PgOutbox {
    /// Starts the listener task once. Returns false when wake-ups are not available (behind a
    /// transaction pooler without a direct `LISTEN` URL): the caller polls.
    pub(super) async fn start_listener(&self) -> bool {
        let source = match (&self.settings.listen_url, self.settings.pooler) {
            (Some(url), _) => Source::Url(url.clone()),
            (None, Pooler::Direct) => Source::Pool,
            (None, _) => return false,
        };
        let pool = self.pool.clone();
        let wake = Arc::downgrade(&self.wake);
        self.wake
            .listener
            .get_or_init(|| async move {
                tokio::spawn(listen(pool, source, wake));
            })
            .await;
        true
    }
}

/// Where the listener's session comes from.
enum Source {
    /// A connection of the pool (a direct pool).
    Pool,
    /// A direct URL of the server.
    Url(String),
}

/// Listens until the repository is dropped or the pool closed. A lost connection ends the
/// listener; a new one listens after a pause (a second when the last one failed to connect or
/// lived less than a second, so that a server or proxy that drops it at once is no loop), and
/// the workers are woken once it listens: what was enqueued while nobody listened is claimed
/// then, and until then the idle workers poll on their own backoff.
///
/// sqlx 0.9.1's `PgListener` reconnects by itself: eagerly, retrying an I/O error other than
/// a refused connection at once and without a pause; or lazily, answering `Ok(None)` at every
/// call while the reconnect fails. Either would be a loop without a pause here, so the
/// listener is dropped at its first `Ok(None)` or error and this loop reconnects.
async fn listen(pool: PgPool, source: Source, wake: std::sync::Weak<Wake>) {
    loop {
        let listener = async {
            let mut l = match &source {
                Source::Pool => PgListener::connect_with(&pool).await?,
                Source::Url(url) => PgListener::connect(url).await?,
            };
            l.eager_reconnect(false);
            l.listen(NOTIFY_CHANNEL).await?;
            Ok::<_, sqlx::Error>(l)
        };
        let mut listener = match listener.await {
            Ok(l) => l,
            Err(e) => {
                tracing::debug!(error = %e, "outbox listener cannot connect; retrying");
                if wake.strong_count() == 0 || pool.is_closed() {
                    return;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let listening = std::time::Instant::now();
        let Some(woken) = wake.upgrade() else { return };
        woken.notify.notify_waiters();
        drop(woken);
        loop {
            let received = listener.try_recv().await;
            let Some(wake) = wake.upgrade() else { return };
            match received {
                Ok(Some(_)) => wake.notify.notify_waiters(),
                Ok(None) => break,
                Err(e) => {
                    tracing::debug!(error = %e, "outbox listener lost its connection");
                    break;
                }
            }
        }
        drop(listener);
        if pool.is_closed() {
            return;
        }
        if listening.elapsed() < Duration::from_secs(1) {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}
