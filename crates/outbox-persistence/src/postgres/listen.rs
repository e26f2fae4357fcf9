//! Waking idle workers on PostgreSQL: one `LISTEN outbox_event` connection per repository
//! (its clones share it), started on the first wait, reconnecting while the pool is open. A
//! statement-level trigger notifies on enqueue.
//!
//! `LISTEN` needs a session of its own. On a direct pool the listener takes a connection of
//! the pool; behind a transaction pooler it connects to [`super::PgSettings::listen_url`] (a
//! direct URL of the server), and without one there is no listener: idle workers poll at
//! their poll interval.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::{NOTIFY_CHANNEL, PgOutbox, Pooler};
use crate::WakeMark;
use crate::wakeups::WakeUps;

/// What the listener shares with the repository's clones.
#[derive(Debug)]
pub(super) struct Wake {
    /// Signalled on every notification, and once each time a listener starts listening (the
    /// listener task holds them too).
    pub(super) wakes: Arc<WakeUps>,
    /// The listener task, started by the first wait (and again by a wait after it ended
    /// with the runtime that ran it).
    listener: Mutex<Option<JoinHandle<()>>>,
    /// Dropped with the repository's last clone: its receiver in the listener task ends the
    /// task (and frees its connection) at once, not at the next notification.
    alive: watch::Sender<()>,
}

impl Default for Wake {
    fn default() -> Self {
        Self {
            wakes: Arc::default(),
            listener: Mutex::new(None),
            alive: watch::Sender::new(()),
        }
    }
}

impl PgOutbox {
    /// Starts the listener task unless it runs. Returns false when wake-ups are not available
    /// (behind a transaction pooler without a direct `LISTEN` URL): the caller polls.
    ///
    /// The task ends only with the repository or its pool, or with the runtime that runs it: a
    /// repository built and first waited on in one runtime (a test's, a setup step's) and then
    /// used in another starts a new task in the new one, where before its workers fell back to
    /// polling for good.
    pub(super) fn start_listener(&self) -> bool {
        if self.settings.listen_url.is_none() && self.settings.pooler != Pooler::Direct {
            return false;
        }
        let mut task = self.wake.listener.lock().unwrap_or_else(|e| e.into_inner());
        if task.as_ref().is_none_or(JoinHandle::is_finished) && !self.pool.is_closed() {
            let source = match &self.settings.listen_url {
                Some(url) => Source::Url(url.clone()),
                None => Source::Pool,
            };
            let ends = Ends {
                pool: self.pool.clone(),
                alive: self.wake.alive.subscribe(),
            };
            *task = Some(tokio::spawn(listen(source, self.wake.wakes.clone(), ends)));
        }
        true
    }

    /// Waits for a notification (one since `since` ends it at once) or `timeout`; behind a
    /// transaction pooler without a direct `LISTEN` URL, sleeps `timeout` (the caller polls).
    pub(super) async fn wait_for_work_after(&self, since: WakeMark, timeout: Duration) {
        if self.start_listener() {
            self.wake.wakes.wait(since, timeout).await;
        } else {
            tokio::time::sleep(timeout).await;
        }
    }
}

/// Where the listener's session comes from.
enum Source {
    /// A connection of the pool (a direct pool).
    Pool,
    /// A direct URL of the server.
    Url(String),
}

/// What ends the listener task: the repository dropped (its last clone) or the pool closed.
struct Ends {
    pool: PgPool,
    alive: watch::Receiver<()>,
}

impl Ends {
    /// Runs `step` unless the listener's end comes first (then `None`).
    async fn unless_ended<T>(&mut self, step: impl Future<Output = T>) -> Option<T> {
        let closed = self.pool.close_event();
        // `close_event` reads the flag before it registers: a close between the two is seen here.
        if self.pool.is_closed() {
            return None;
        }
        tokio::select! {
            // Nothing is ever sent: `changed` returns only when the sender is dropped.
            _ = self.alive.changed() => None,
            _ = closed => None,
            out = step => Some(out),
        }
    }
}

/// Listens until the repository is dropped or the pool closed (either ends it at once, also
/// while it waits for a notification or reconnects). A lost connection ends the listener; a
/// new one listens after a pause (a second when the last one failed to connect or lived less
/// than a second, so that a server or proxy that drops it at once is no loop), and the workers
/// are woken once it listens: what was enqueued while nobody listened is claimed then, and
/// until then the idle workers poll on their own backoff.
///
/// sqlx 0.9.1's `PgListener` reconnects by itself: eagerly, retrying an I/O error other than
/// a refused connection at once and without a pause; or lazily, answering `Ok(None)` at every
/// call while the reconnect fails. Either would be a loop without a pause here, so the
/// listener is dropped at its first `Ok(None)` or error and this loop reconnects.
async fn listen(source: Source, wakes: Arc<WakeUps>, mut ends: Ends) {
    let pause = Duration::from_secs(1);
    loop {
        let pool = ends.pool.clone();
        let connect = async {
            let mut l = match &source {
                Source::Pool => PgListener::connect_with(&pool).await?,
                Source::Url(url) => PgListener::connect(url).await?,
            };
            l.eager_reconnect(false);
            l.listen(NOTIFY_CHANNEL).await?;
            Ok::<_, sqlx::Error>(l)
        };
        let mut listener = match ends.unless_ended(connect).await {
            None => return,
            Some(Ok(l)) => l,
            Some(Err(e)) => {
                tracing::debug!(error = %e, "outbox listener cannot connect; retrying");
                if ends.unless_ended(tokio::time::sleep(pause)).await.is_none() {
                    return;
                }
                continue;
            }
        };
        let listening = std::time::Instant::now();
        wakes.wake();
        loop {
            let Some(received) = ends.unless_ended(listener.try_recv()).await else {
                return;
            };
            match received {
                Ok(Some(_)) => wakes.wake(),
                Ok(None) => break,
                Err(e) => {
                    tracing::debug!(error = %e, "outbox listener lost its connection");
                    break;
                }
            }
        }
        drop(listener);
        if listening.elapsed() < pause
            && ends.unless_ended(tokio::time::sleep(pause)).await.is_none()
        {
            return;
        }
    }
}
