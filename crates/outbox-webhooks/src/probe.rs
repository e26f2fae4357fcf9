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
//! An endpoint that answers, but slowly (a send took [`SlowLimit::after`] or longer, or one in
//! flight has run that long), is held to [`SlowLimit::sends`] sends in flight from this process:
//! the others are snoozed (not sent, not counted: a receiver that answers is not failing) and
//! come back after about its answer time, so a slow receiver takes a bounded share of the workers
//! instead of every worker whose batch holds one of its many records' deliveries. A fast answer
//! ends it, once no send in flight has run that long.
//!
//! An endpoint that asked to be left alone for a while (a 429, 502, 503 or 504 with a
//! `Retry-After`) is not sent to by this process until then: its other deliveries are snoozed
//! until about that time, uncounted, instead of each spending a send (and a failure in a row)
//! on the same refusal.
//!
//! The state is per process and per endpoint, in memory. A process that has not sent to an
//! endpoint yet takes the endpoint's failures in a row from the database (the other processes'
//! attempts): when its last attempt failed, the first send is a probe too, so a restarted
//! process does not spend one send per worker learning what the others knew.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_events::MAX_SNOOZE;

/// What a delivery may do now.
pub(crate) enum Admission {
    /// Send, keeping the guard while the send runs (its drop ends the probe when it is one).
    Send(SendGuard),
    /// Do not send: the endpoint has given this process no answer since this instant.
    Hold(Instant),
    /// Do not send yet, uncounted: the endpoint is slow and this many sends to it are in
    /// flight from this process; about this long (its slow answer's time, or the oldest send
    /// in flight's, whichever is longer) until one ends.
    Busy(usize, Duration),
    /// Do not send yet, uncounted: the endpoint asked to be left alone (`Retry-After`) for
    /// about this much longer.
    Throttled(Duration),
}

/// How many sends an endpoint that answers slowly may have in flight from one process.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SlowLimit {
    /// A send that takes this long (answered, or still in flight) makes its endpoint slow.
    pub(crate) after: Duration,
    /// The sends a slow endpoint may have in flight (at least one, so that a send can find it
    /// fast again).
    pub(crate) sends: usize,
}

#[derive(Debug, Default)]
struct State {
    silent_since: Option<Instant>,
    probing: bool,
    last_probe: Option<Instant>,
    /// This process's sends to it in flight: their guards' numbers and starts.
    sending: Vec<(u64, Instant)>,
    /// Its last answer took [`SlowLimit::after`] or longer: how long.
    slow: Option<Duration>,
    /// It asked (`Retry-After`) not to be sent to before this instant.
    throttled_until: Option<Instant>,
    /// When it last answered a send.
    answered_at: Option<Instant>,
}

impl State {
    /// Whether the endpoint is slow now: its last answer was, or a send in flight is.
    fn slow(&self, after: Duration) -> bool {
        self.slow.is_some() || self.sending.iter().any(|(_, at)| at.elapsed() >= after)
    }
}

/// The endpoints of one sender.
#[derive(Debug, Clone)]
pub(crate) struct Probes {
    states: Arc<Mutex<HashMap<String, State>>>,
    spacing: Duration,
    slow: SlowLimit,
    /// The next guard's number.
    next: Arc<std::sync::atomic::AtomicU64>,
}

/// One send in flight (the probe, when `probe`), which ends when it is dropped.
pub(crate) struct SendGuard {
    probes: Probes,
    endpoint: String,
    probe: bool,
    number: u64,
}

impl Drop for SendGuard {
    fn drop(&mut self) {
        let mut states = self.probes.lock();
        if let Some(state) = states.get_mut(&self.endpoint) {
            state.sending.retain(|(n, _)| *n != self.number);
            if self.probe {
                state.probing = false;
                state.last_probe = Some(Instant::now());
            }
        }
    }
}

impl Probes {
    /// Probes at least `spacing` apart (from the end of one to the start of the next); slow
    /// endpoints held to `slow`.
    pub(crate) fn new(spacing: Duration, slow: SlowLimit) -> Self {
        Self {
            states: Arc::default(),
            spacing,
            slow: SlowLimit {
                sends: slow.sends.max(1),
                ..slow
            },
            next: Arc::default(),
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
        if let Some(until) = state.throttled_until {
            let now = Instant::now();
            if until > now {
                return Admission::Throttled(until - now);
            }
            state.throttled_until = None;
        }
        let spaced = state
            .last_probe
            .is_none_or(|at| at.elapsed() >= self.spacing);
        let probe = match state.silent_since {
            Some(since) if state.probing || !spaced => return Admission::Hold(since),
            Some(_) => true,
            None => false,
        };
        if !probe && state.sending.len() >= self.slow.sends && state.slow(self.slow.after) {
            let oldest = state.sending.iter().map(|(_, at)| at.elapsed()).max();
            let answer = oldest
                .unwrap_or_default()
                .max(state.slow.unwrap_or_default());
            return Admission::Busy(state.sending.len(), answer);
        }
        state.probing |= probe;
        let number = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        state.sending.push((number, Instant::now()));
        Admission::Send(SendGuard {
            probes: self.clone(),
            endpoint: endpoint.to_string(),
            probe,
            number,
        })
    }

    /// `endpoint` answered a send (any status) that took `took`; `asked`: the answer asked
    /// (a slow-down status with `Retry-After`) not to be sent to for that long, so until then
    /// this process sends it nothing (a shorter ask never shortens a longer one; held to
    /// [`MAX_SNOOZE`]).
    pub(crate) fn answered(&self, endpoint: &str, took: Duration, asked: Option<Duration>) {
        let now = Instant::now();
        let mut states = self.lock();
        let state = states.entry(endpoint.to_string()).or_default();
        state.silent_since = None;
        state.answered_at = Some(now);
        state.slow = (took >= self.slow.after).then_some(took);
        if let Some(until) = asked.and_then(|wait| now.checked_add(wait.min(MAX_SNOOZE))) {
            state.throttled_until = Some(state.throttled_until.map_or(until, |u| u.max(until)));
        }
    }

    /// A send to `endpoint` that began at `started` got no answer. Not counted as silence when
    /// the endpoint has answered another send since that one began: it answers (a send that
    /// hung through a throttle must not turn the deliveries coming back after it into holds
    /// counted as failures).
    pub(crate) fn silent(&self, endpoint: &str, started: Instant) {
        let mut states = self.lock();
        let state = states.entry(endpoint.to_string()).or_default();
        if state.answered_at.is_some_and(|at| at > started) {
            return;
        }
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

    const UNLIMITED: SlowLimit = SlowLimit {
        after: Duration::from_secs(3600),
        sends: usize::MAX,
    };

    const FAST: Duration = Duration::from_millis(1);

    #[test]
    fn a_silent_endpoint_gets_one_send_at_a_time_until_it_answers() {
        let p = Probes::new(Duration::ZERO, UNLIMITED);
        assert!(sends(&p.admit("a", false)), "unknown endpoints are sent to");
        p.silent("a", Instant::now());
        let probe = p.admit("a", false);
        assert!(probes(&probe));
        assert!(holds(&p.admit("a", false)));
        assert!(sends(&p.admit("b", false)), "another endpoint is not held");
        drop(probe);
        let probe = p.admit("a", false);
        assert!(probes(&probe), "the next probe goes once the last ended");
        p.answered("a", FAST, None);
        drop(probe);
        assert!(sends(&p.admit("a", false)));
    }

    #[test]
    fn a_process_new_to_a_failing_endpoint_probes_first() {
        let p = Probes::new(Duration::ZERO, UNLIMITED);
        let probe = p.admit("a", true);
        assert!(probes(&probe));
        assert!(holds(&p.admit("a", true)));
        p.answered("a", FAST, None);
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
        let p = Probes::new(Duration::from_secs(60), UNLIMITED);
        p.silent("a", Instant::now());
        drop(p.admit("a", false));
        assert!(
            holds(&p.admit("a", false)),
            "the next probe waits out the spacing"
        );
        p.answered("a", FAST, None);
        assert!(sends(&p.admit("a", false)));
    }

    fn busy(a: &Admission) -> bool {
        matches!(a, Admission::Busy(..))
    }

    #[test]
    fn a_slow_endpoint_gets_a_bounded_number_of_sends_until_one_is_fast() {
        let slow = SlowLimit {
            after: Duration::from_secs(1),
            sends: 2,
        };
        let p = Probes::new(Duration::ZERO, slow);
        let first: Vec<Admission> = (0..5).map(|_| p.admit("a", false)).collect();
        assert!(
            first.iter().all(sends),
            "an endpoint not known to be slow takes every send"
        );
        drop(first);
        p.answered("a", Duration::from_secs(2), None);
        let (one, two) = (p.admit("a", false), p.admit("a", false));
        assert!(sends(&one) && sends(&two));
        assert!(
            busy(&p.admit("a", false)),
            "a third send to a slow endpoint"
        );
        assert!(sends(&p.admit("b", false)), "another endpoint is not held");
        drop(one);
        let three = p.admit("a", false);
        assert!(sends(&three), "a slot freed");
        p.answered("a", FAST, None);
        assert!(
            sends(&p.admit("a", false)),
            "a fast answer ends it, with two in flight"
        );
        drop((two, three));
    }

    #[test]
    fn a_send_in_flight_for_long_makes_its_endpoint_slow() {
        let slow = SlowLimit {
            after: Duration::from_millis(300),
            sends: 1,
        };
        let p = Probes::new(Duration::ZERO, slow);
        let long = p.admit("a", false);
        assert!(sends(&p.admit("a", false)), "not slow yet");
        std::thread::sleep(Duration::from_millis(350));
        assert!(busy(&p.admit("a", false)));
        drop(long);
        assert!(
            sends(&p.admit("a", false)),
            "no send in flight: nothing holds it (it never answered slowly)"
        );
    }

    #[test]
    fn a_throttled_endpoint_gets_no_send_until_its_time() {
        let p = Probes::new(Duration::ZERO, UNLIMITED);
        let started = Instant::now();
        assert!(sends(&p.admit("a", false)));
        p.answered("a", FAST, Some(Duration::from_millis(400)));
        // A shorter ask does not shorten the first.
        p.answered("a", FAST, Some(Duration::from_millis(10)));
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            matches!(p.admit("a", false), Admission::Throttled(_)),
            "the endpoint asked for 400 ms"
        );
        assert!(sends(&p.admit("b", false)), "other endpoints are not held");
        // A send that began before those answers and got none does not make it silent.
        p.silent("a", started);
        std::thread::sleep(Duration::from_millis(400));
        assert!(
            sends(&p.admit("a", false)),
            "sent again once the time passed, not held as silent"
        );
    }

    #[test]
    fn a_limit_of_zero_still_lets_one_send_go() {
        let p = Probes::new(
            Duration::ZERO,
            SlowLimit {
                after: Duration::ZERO,
                sends: 0,
            },
        );
        p.answered("a", FAST, None);
        let one = p.admit("a", false);
        assert!(sends(&one));
        assert!(busy(&p.admit("a", false)));
    }
}
