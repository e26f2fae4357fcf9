//! Paused event types (docs/console.md, "Pause and resume"): every dispatcher re-reads
//! `_System_OutboxPausedType` every [`PAUSE_REFRESH`] and narrows the scope of each claim by
//! it, so no worker claims a row of a paused type once the refresh has seen the pause. A record
//! whose head is of a paused type waits behind it in order, as behind any head outside the
//! scope; resuming needs nothing else.

use std::sync::Arc;
use std::time::Duration;

use outbox_persistence::{OutboxRepository, Scope};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// How often a dispatcher re-reads the paused event types: a pause or resume is seen by every
/// process within this time (plus one claim already under way).
pub const PAUSE_REFRESH: Duration = Duration::from_secs(1);

/// The event types paused as this process last read them; `None` until the first read.
#[derive(Clone)]
pub(crate) struct Paused {
    rx: watch::Receiver<Option<Arc<Vec<String>>>>,
    tx: Arc<watch::Sender<Option<Arc<Vec<String>>>>>,
}

impl Default for Paused {
    /// Nothing paused, and no refresh expected (a runner of single claims).
    fn default() -> Self {
        let (tx, rx) = watch::channel(Some(Arc::new(Vec::new())));
        Self {
            rx,
            tx: Arc::new(tx),
        }
    }
}

impl Paused {
    /// A set read by [`run`]: claims wait for its first read.
    pub(crate) fn unread() -> Self {
        let (tx, rx) = watch::channel(None);
        Self {
            rx,
            tx: Arc::new(tx),
        }
    }

    /// `scope` without the paused event types, once the first read is done (or `stop`).
    pub(crate) async fn narrow(&self, scope: &Scope, stop: &CancellationToken) -> Scope {
        let mut rx = self.rx.clone();
        let paused = tokio::select! {
            read = rx.wait_for(Option::is_some) => match read {
                Ok(read) => read.clone().unwrap_or_default(),
                Err(_) => Arc::default(),
            },
            _ = stop.cancelled() => Arc::default(),
        };
        if paused.is_empty() {
            scope.clone()
        } else {
            narrow(scope, Scope::Except(paused.to_vec()))
        }
    }

    /// Whether `event_type` is paused as last read (without waiting for a first read).
    pub(crate) fn is_paused(&self, event_type: &str) -> bool {
        self.rx
            .borrow()
            .as_ref()
            .is_some_and(|types| types.iter().any(|t| t == event_type))
    }

    fn set(&self, types: Vec<String>) {
        self.tx.send_if_modified(|current| {
            if current.as_deref() == Some(&types) {
                return false;
            }
            if current.is_some() || !types.is_empty() {
                tracing::info!(paused = ?types, "paused event types changed");
            }
            *current = Some(Arc::new(types));
            true
        });
    }
}

/// Re-reads the paused event types every [`PAUSE_REFRESH`] until `stop`. A failed read keeps
/// the last set (a first one that fails counts as nothing paused, so a database without the
/// pause table still dispatches), with one warning per run of failures.
pub(crate) async fn run(repo: Arc<dyn OutboxRepository>, paused: Paused, stop: CancellationToken) {
    let mut failing = false;
    while !stop.is_cancelled() {
        match repo.paused_event_types().await {
            Ok(types) => {
                failing = false;
                paused.set(types.into_iter().map(|p| p.event_type).collect());
            }
            Err(e) => {
                crate::metrics::pause_read_failed();
                if !std::mem::replace(&mut failing, true) {
                    tracing::warn!(error = %e.chain(), "could not read the paused event types; keeping the last known set");
                }
                if paused.rx.borrow().is_none() {
                    paused.set(Vec::new());
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(PAUSE_REFRESH) => {}
            _ = stop.cancelled() => {}
        }
    }
}

/// The event types both `scope` and `within` name.
pub(crate) fn narrow(scope: &Scope, within: Scope) -> Scope {
    let keep = |types: &[String], pred: &dyn Fn(&String) -> bool| -> Vec<String> {
        types.iter().filter(|t| pred(t)).cloned().collect()
    };
    match (scope, within) {
        (Scope::All, within) => within,
        (Scope::Only(a), Scope::All) => Scope::Only(a.clone()),
        (Scope::Only(a), Scope::Only(b)) => Scope::Only(keep(a, &|t| b.contains(t))),
        (Scope::Only(a), Scope::Except(b)) => Scope::Only(keep(a, &|t| !b.contains(t))),
        (Scope::Except(a), Scope::All) => Scope::Except(a.clone()),
        (Scope::Except(a), Scope::Only(b)) => Scope::Only(keep(&b, &|t| !a.contains(t))),
        (Scope::Except(a), Scope::Except(b)) => {
            let extra = keep(a, &|t| !b.contains(t));
            Scope::Except(b.into_iter().chain(extra).collect())
        }
    }
}
