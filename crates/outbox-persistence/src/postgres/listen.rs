//! Waking idle workers on PostgreSQL: one `LISTEN outbox_event` connection per repository
//! (its clones share it), started on the first wait, reconnecting while the pool is open. A
//! statement-level trigger notifies on enqueue.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::{Notify, OnceCell};

use super::{NOTIFY_CHANNEL, PgOutbox};

/// What the listener shares with the repository's clones.
#[derive(Debug, Default)]
pub(super) struct Wake {
    /// Notified on every notification, and when the listener loses its connection.
    pub(super) notify: Notify,
    listener: OnceCell<()>,
}

impl PgOutbox {
    /// Starts the listener task once.
    pub(super) async fn start_listener(&self) {
        let pool = self.pool.clone();
        let wake = Arc::downgrade(&self.wake);
        self.wake
            .listener
            .get_or_init(|| async move {
                tokio::spawn(listen(pool, wake));
            })
            .await;
    }
}

/// Listens until the repository is dropped or the pool closed, reconnecting every second.
async fn listen(pool: PgPool, wake: std::sync::Weak<Wake>) {
    loop {
        let listener = async {
            let mut l = PgListener::connect_with(&pool).await?;
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
