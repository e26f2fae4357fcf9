//! The endpoints as the fan-out and the delivery read them: once a second per process, not
//! once per event (two statements of every delivered event saved), and again at once after a
//! change made through [`crate::Webhooks`] in this process. A change made by another process
//! (the CLI, the console) reaches this one within [`FRESH_FOR`]: an endpoint added receives the
//! events fanned out from then on, a rotated secret signs from then on (the receivers accept
//! both during the overlap), and a disable stops sends (its pause stops the claims first).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_events::OutboxRepository;
use outbox_events::persistence::Tx;
use outbox_events::persistence::webhooks::{self, WebhookEndpoint};

/// How long a read of the endpoints is used.
pub const FRESH_FOR: Duration = Duration::from_secs(1);

/// Bumped by every change made through this process's [`crate::Webhooks`].
static CHANGES: AtomicU64 = AtomicU64::new(0);

/// A change was made in this process: the next read goes to the database.
pub(crate) fn changed() {
    CHANGES.fetch_add(1, Ordering::SeqCst);
}

type Read = (Instant, u64, Arc<Vec<WebhookEndpoint>>);

/// A handler's read of the endpoints (the fan-out and the delivery each keep one).
#[derive(Debug, Clone, Default)]
pub(crate) struct Endpoints {
    read: Arc<Mutex<Option<Read>>>,
    /// Held by a read through the pool: the deliveries of a batch, run side by side, that
    /// find the last read stale make one read, not one each.
    reading: Arc<tokio::sync::Mutex<()>>,
}

impl Endpoints {
    /// Every endpoint (with its secrets), read through `tx` when the last read is stale.
    pub(crate) async fn all(
        &self,
        tx: &mut Tx,
    ) -> outbox_events::persistence::Result<Arc<Vec<WebhookEndpoint>>> {
        match self.cached() {
            Some(endpoints) => Ok(endpoints),
            None => self.fresh(tx).await,
        }
    }

    /// The last read, while it is fresh and no change was made through this process since.
    pub(crate) fn cached(&self) -> Option<Arc<Vec<WebhookEndpoint>>> {
        let changes = CHANGES.load(Ordering::SeqCst);
        match &*self.read.lock().unwrap_or_else(|e| e.into_inner()) {
            Some((at, seen, endpoints)) if at.elapsed() < FRESH_FOR && *seen == changes => {
                Some(endpoints.clone())
            }
            _ => None,
        }
    }

    async fn fresh(
        &self,
        tx: &mut Tx,
    ) -> outbox_events::persistence::Result<Arc<Vec<WebhookEndpoint>>> {
        let changes = CHANGES.load(Ordering::SeqCst);
        // Stamped with its start: a read is as fresh as the moment it began, and one that
        // began before the cached one does not replace it (two reads overlap: a handler's in
        // its transaction, another's through the pool).
        let began = Instant::now();
        let endpoints = Arc::new(webhooks::endpoints_to_send(tx).await?);
        let mut read = self.read.lock().unwrap_or_else(|e| e.into_inner());
        if read.as_ref().is_none_or(|(at, _, _)| *at <= began) {
            *read = Some((began, changes, endpoints.clone()));
        }
        Ok(endpoints)
    }

    /// The endpoint `name`, if there is one, enabled or not. One the last read does not hold,
    /// or holds disabled, is read again: another process may have added it (and fanned out to
    /// it) or enabled it (and made its deliveries due) a moment ago, so a delivery never takes
    /// an endpoint for removed, or waits an hour for one already enabled, on a stale read.
    pub(crate) async fn get(
        &self,
        tx: &mut Tx,
        name: &str,
    ) -> outbox_events::persistence::Result<Option<WebhookEndpoint>> {
        if let Some(found) = self.cached_enabled(name) {
            return Ok(Some(found));
        }
        let endpoints = self.fresh(tx).await?;
        Ok(endpoints.iter().find(|e| e.name == name).cloned())
    }

    /// [`Endpoints::get`] for a delivery run without the attempt's transaction (beside others
    /// of its batch): read through the pool when the last read does not hold it enabled.
    pub(crate) async fn get_pooled(
        &self,
        repo: &dyn OutboxRepository,
        name: &str,
    ) -> outbox_events::persistence::Result<Option<WebhookEndpoint>> {
        if let Some(found) = self.cached_enabled(name) {
            return Ok(Some(found));
        }
        let endpoints = self.fresh_pooled(repo).await?;
        Ok(endpoints.iter().find(|e| e.name == name).cloned())
    }

    /// [`Endpoints::all`] for a handler run without the attempt's transaction.
    pub(crate) async fn all_pooled(
        &self,
        repo: &dyn OutboxRepository,
    ) -> outbox_events::persistence::Result<Arc<Vec<WebhookEndpoint>>> {
        match self.cached() {
            Some(endpoints) => Ok(endpoints),
            None => self.fresh_pooled(repo).await,
        }
    }

    /// A read on a transaction of its own from `repo`, made once while the other handlers of
    /// this process that want one wait for it (a read that began while they waited serves
    /// them).
    async fn fresh_pooled(
        &self,
        repo: &dyn OutboxRepository,
    ) -> outbox_events::persistence::Result<Arc<Vec<WebhookEndpoint>>> {
        let asked = Instant::now();
        let _reading = self.reading.lock().await;
        if let Some(endpoints) = self.cached_since(asked) {
            return Ok(endpoints);
        }
        let mut tx = repo.begin().await?;
        let read = self.fresh(&mut tx).await;
        // A read: a failed rollback changes nothing (the connection goes back either way).
        let _ = tx.rollback().await;
        read
    }

    /// The last read, if it is fresh and began after `asked`.
    fn cached_since(&self, asked: Instant) -> Option<Arc<Vec<WebhookEndpoint>>> {
        let changes = CHANGES.load(Ordering::SeqCst);
        match &*self.read.lock().unwrap_or_else(|e| e.into_inner()) {
            Some((at, seen, endpoints))
                if *at >= asked && at.elapsed() < FRESH_FOR && *seen == changes =>
            {
                Some(endpoints.clone())
            }
            _ => None,
        }
    }

    /// The enabled endpoint `name` in the last read, while it is fresh.
    fn cached_enabled(&self, name: &str) -> Option<WebhookEndpoint> {
        self.cached()?
            .iter()
            .find(|e| e.name == name && e.enabled)
            .cloned()
    }
}
