//! One outbox writer at a time per database file within this process.
//!
//! SQLite has one writer per database file. When two connections of one process both want
//! it, the one that finds it taken does not queue: its busy handler sleeps (1, 2, 5, 10 … up to
//! 100 ms) and tries again, so a worker whose attempt ended a microsecond after the sleep
//! began still waits the whole sleep. Measured on the bench's SQLite drains (`strace -c -f`
//! over `outbox-bench --quick --only sqlite`): 2,025 such sleeps of 5.1 ms on average, more
//! time asleep than working. The outbox's own writers in one process (claims, attempts,
//! heartbeats, detached bookkeeping, the pruner, operator writes) therefore queue here first,
//! first come first served, and take SQLite's lock only when it is free of them; the busy
//! timeout still bounds waits for other processes and for the application's own transactions,
//! which do not queue here (a handler may open one while its attempt holds the gate).
//!
//! Every repository over the same file in this process shares one gate (they share SQLite's
//! lock too). The wait is bounded by the pool's busy timeout (registered by
//! [`crate::Database::connect`]; [`crate::DEFAULT_LOCK_TIMEOUT`] for a pool opened elsewhere),
//! and a wait that reaches it is a [`crate::Error::LockTimeout`], as SQLite's own would be.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use sqlx::SqlitePool;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::{DEFAULT_LOCK_TIMEOUT, Error, Result};

/// The gates of the files this process has opened, by file name (a few words each; kept, so
/// that the bound set by [`Gate::bound`] holds for every pool opened on the file later).
static GATES: LazyLock<Mutex<HashMap<String, Arc<Gate>>>> = LazyLock::new(Mutex::default);

/// The writers' queue of one database file.
#[derive(Debug)]
pub(crate) struct Gate {
    queue: Arc<Semaphore>,
    wait: Mutex<Duration>,
}

/// The turn of one writer: the gate opens for the next when it is dropped.
pub(crate) type Turn = OwnedSemaphorePermit;

impl Gate {
    /// The gate of `pool`'s file, shared with every other repository over that file.
    pub(crate) fn of(pool: &SqlitePool) -> Arc<Gate> {
        let options = pool.connect_options();
        let file = options.get_filename().to_string_lossy().into_owned();
        let fresh = || {
            Arc::new(Gate {
                queue: Arc::new(Semaphore::new(1)),
                wait: Mutex::new(DEFAULT_LOCK_TIMEOUT),
            })
        };
        if file.is_empty() || file == ":memory:" {
            return fresh();
        }
        let mut gates = GATES.lock().unwrap_or_else(|e| e.into_inner());
        gates.entry(file).or_insert_with(fresh).clone()
    }

    /// Bounds the waits at the gate of `pool`'s file by `wait` (its connections' busy timeout;
    /// the pool opened last on a file sets it).
    pub(crate) fn bound(pool: &SqlitePool, wait: Duration) -> Arc<Gate> {
        let gate = Gate::of(pool);
        *gate.wait.lock().unwrap_or_else(|e| e.into_inner()) = wait;
        gate
    }

    /// Waits for this writer's turn, at most the bound.
    pub(crate) async fn turn(&self) -> Result<Turn> {
        let wait = *self.wait.lock().unwrap_or_else(|e| e.into_inner());
        match tokio::time::timeout(wait, self.queue.clone().acquire_owned()).await {
            Ok(Ok(turn)) => Ok(turn),
            Ok(Err(_closed)) => unreachable!("the gate's semaphore is never closed"),
            Err(_elapsed) => Err(Error::LockTimeout(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "waited {wait:?} for the other outbox writers of this process on this SQLite file"
                ),
            )))),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::Gate;

    #[tokio::test]
    async fn one_file_one_queue_and_a_bounded_wait() {
        let path = std::env::temp_dir().join(format!("outbox_gate_{}.db", uuid::Uuid::now_v7()));
        let url = format!("sqlite://{}?mode=rwc", path.display());
        let a = sqlx::SqlitePool::connect(&url).await.unwrap();
        let b = sqlx::SqlitePool::connect(&url).await.unwrap();
        let gate = Gate::bound(&a, Duration::from_millis(50));
        assert!(std::sync::Arc::ptr_eq(&gate, &Gate::of(&b)));
        let turn = Gate::of(&b).turn().await.unwrap();
        let waited = std::time::Instant::now();
        let second = gate.turn().await;
        assert!(
            matches!(second, Err(crate::Error::LockTimeout(_))),
            "{second:?}"
        );
        assert!(waited.elapsed() >= Duration::from_millis(50));
        drop(turn);
        drop(gate.turn().await.unwrap());
        a.close().await;
        b.close().await;
        std::fs::remove_file(&path).ok();
    }
}
