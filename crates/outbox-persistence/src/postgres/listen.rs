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
    /// Notified on every notification, and when the listener loses its connection.
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

/// Listens until the repository is dropped or the pool closed, reconnecting every second.
async fn listen(pool: PgPool, source: Source, wake: std::sync::Weak<Wake>) {
    loop {
        let listener = async {
            let mut l = match &source {
                Source::Pool => PgListener::connect_with(&pool).await?,
                Source::Url(url) => PgListener::connect(url).await?,
            };
            // A lost connection ends `try_recv` with `Ok(None)` and the next call reconnects
            // once, its error ending this listener (below: a new one a second later). sqlx
            // 0.9.1's eager reconnect retries an I/O error other than a refused connection
            // (a reset, an unreachable host) at once, in a loop without a pause.
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
        loop {
            let received = listener.try_recv().await;
            let Some(wake) = wake.upgrade() else { return };
            // A lost connection also wakes the workers: they poll once and fall back to their
            // poll interval while the listener reconnects.
            wake.notify.notify_waiters();
            match received {
                Ok(Some(_)) => {}
                Ok(None) => {}
                Err(_) => break,
            }
        }
        if pool.is_closed() {
            return;
        }
    }
}
