//! One send at a time to an endpoint that gives no answer.
//!
//! A receiver that is down, unreachable or hanging costs a worker up to the whole timeout per
//! send (15 s by default). Its deliveries are many (one head per record), so without a limit
//! they would come due together and take every worker, and the other endpoints' deliveries
//! would wait behind them. Once a send to an endpoint got no answer (no connection, a timeout,
//! a connection dropped mid-request), this process sends to it one delivery at a time, the
//! probe; the others are not sent and retried on their schedule, counted like the failed send
//! they would have been (so a dead endpoint is disabled as surely as before). Any answer, even
//! a 500, ends it: an endpoint that answers fails fast and needs no probe. Probes are spaced
//! (a second apart; ten where the attempt holds the database's one write lock during the send,
//! SQLite, so that a hanging endpoint does not keep every writer waiting).
//!
//! The state is per process and per endpoint, in memory. A process that has not sent to an
//! endpoint yet takes the endpoint's failures in a row from the database (the other processes'
//! attempts): when its last attempt failed, the first send is a probe too, so a restarted
//! process does not spend one send per worker learning what the others knew.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a delivery may do now.
pub(crate) enum Admission {
    /// Send, keeping the guard while the send runs (its drop ends the probe when it is one).
    Send(SendGuard),
    /// Do not send: the endpoint has given this process no answer since this instant.
    Hold(Instant),
}

#[derive(Debug, Default)]
struct State {
    silent_since: Option<Instant>,
    probing: bool,
    last_probe: Option<Instant>,
}

/// The endpoints of one sender.
#[derive(Debug, Clone)]
pub(crate) struct Probes {
    states: Arc<Mutex<HashMap<String, State>>>,
    spacing: Duration,
}

/// One send in flight: the probe, when `probe`, which ends when it is dropped.
pub(crate) struct SendGuard {
    probes: Probes,
    endpoint: String,
    probe: bool,
}

impl Drop for SendGuard {
    fn drop(&mut self) {
        if !self.probe {
            return;
        }
        let mut states = self.probes.lock();
        if let Some(state) = states.get_mut(&self.endpoint) {
            state.probing = false;
            state.last_probe = Some(Instant::now());
        }
    }
}

impl Probes {
    /// Probes at least `spacing` apart (from the end of one to the start of the next).
    pub(crate) fn new(spacing: Duration) -> Self {
        Self {
            states: Arc::default(),
            spacing,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, State>> {
        self.states.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a delivery to `endpoint` may be sent now; `failing`: the database says its
    /// last attempt failed (used only while this process has not sent to it).
    pub(crate) fn admit(&self, endpoint: &str, failing: bool) -> Admission {
        let mut states = self.lock();
        let state = states.entry(endpoint.to_string()).or_insert_with(|| State {
            silent_since: failing.then(Instant::now),
            ..State::default()
        });
        let spaced = state
            .last_probe
            .is_none_or(|at| at.elapsed() >= self.spacing);
        let probe = match state.silent_since {
            Some(since) if state.probing || !spaced => return Admission::Hold(since),
            Some(_) => true,
            None => false,
        };
        state.probing |= probe;
        Admission::Send(SendGuard {
            probes: self.clone(),
            endpoint: endpoint.to_string(),
            probe,
        })
    }

    /// `endpoint` answered a send (any status).
    pub(crate) fn answered(&self, endpoint: &str) {
        let mut states = self.lock();
        if let Some(state) = states.get_mut(endpoint) {
            state.silent_since = None;
        }
    }

    /// A send to `endpoint` got no answer.
    pub(crate) fn silent(&self, endpoint: &str) {
        let mut states = self.lock();
        let state = states.entry(endpoint.to_string()).or_default();
        state.silent_since.get_or_insert_with(Instant::now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sends(a: &Admission) -> bool {
        matches!(a, Admission::Send(g) if !g.probe)
    }

    fn probes(a: &Admission) -> bool {
        matches!(a, Admission::Send(g) if g.probe)
    }

    fn holds(a: &Admission) -> bool {
        matches!(a, Admission::Hold(_))
    }

    #[test]
    fn a_silent_endpoint_gets_one_send_at_a_time_until_it_answers() {
        let p = Probes::new(Duration::ZERO);
        assert!(sends(&p.admit("a", false)), "unknown endpoints are sent to");
        p.silent("a");
        let probe = p.admit("a", false);
        assert!(probes(&probe));
        assert!(holds(&p.admit("a", false)));
        assert!(sends(&p.admit("b", false)), "another endpoint is not held");
        drop(probe);
        let probe = p.admit("a", false);
        assert!(probes(&probe), "the next probe goes once the last ended");
        p.answered("a");
        drop(probe);
        assert!(sends(&p.admit("a", false)));
    }

    #[test]
    fn a_process_new_to_a_failing_endpoint_probes_first() {
        let p = Probes::new(Duration::ZERO);
        let probe = p.admit("a", true);
        assert!(probes(&probe));
        assert!(holds(&p.admit("a", true)));
        p.answered("a");
        drop(probe);
        assert!(
            sends(&p.admit("a", true)),
            "what this process saw outranks the database's count"
        );
        assert!(sends(&p.admit("b", false)));
        assert!(
            sends(&p.admit("b", true)),
            "an endpoint this process sent to already"
        );
    }

    #[test]
    fn probes_are_spaced() {
        let p = Probes::new(Duration::from_secs(60));
        p.silent("a");
        drop(p.admit("a", false));
        assert!(
            holds(&p.admit("a", false)),
            "the next probe waits out the spacing"
        );
        p.answered("a");
        assert!(sends(&p.admit("a", false)));
    }
}
