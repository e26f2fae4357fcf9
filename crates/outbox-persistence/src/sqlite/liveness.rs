//! How SQLite decides that a claim is stale: not by comparing its `LastModifiedDate` with a
//! wall clock, but by observing it unchanged for `stale_after` of monotonic time, so a step of
//! the host's clock never makes a live claim look stale.
//!
//! A repository that has just started therefore waits one `stale_after` before it reclaims
//! anything, and it does not count as silence the intervals in which it could not look (the
//! write lock was held by a long attempt, which cannot heartbeat meanwhile).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

use super::time::format_ts;
use crate::{ClockShift, EventId};

/// What this repository has seen of the `processing` rows: each row's `LastModifiedDate` and
/// since when (monotonic, plus the clock shift) it has been seen unchanged. A row unchanged for
/// `stale_after` is stale.
///
/// A look that holds the write lock keeps the books: when the repository could not look for a
/// while (it waited long for the write lock, a lock wait timed out, or its last look is long
/// ago), a claim's holder may have been inside an attempt, which holds the write lock and
/// cannot heartbeat; that blind interval is not counted as silence (each row's clock moves
/// forward by it). A row observed unchanged for [`SILENCE_CAP`] times `stale_after` is stale
/// whatever the blind intervals, so steady load cannot keep a dead claim from being reclaimed.
/// Looks without the lock (`stats`, `get_pending_events`) only add what they see first, and
/// fresher values; they never touch the books.
#[derive(Debug)]
pub(super) struct Liveness {
    origin: Instant,
    seen: HashMap<String, Seen>,
    last_look: Option<Duration>,
    restart_since: Option<Duration>,
}

/// A row's observation.
#[derive(Debug)]
struct Seen {
    last_modified: String,
    /// Since when it counts as silent (moved forward over blind intervals).
    since_micros: i64,
    /// When this value was first seen (never moved).
    first_micros: i64,
}

/// A row observed unchanged for this many times `stale_after` is stale, blind intervals or not.
const SILENCE_CAP: i64 = 3;

impl Liveness {
    pub(super) fn new() -> Self {
        Self {
            origin: Instant::now(),
            seen: HashMap::new(),
            last_look: None,
            restart_since: None,
        }
    }

    /// Monotonic microseconds since the origin, plus the clock shift.
    fn now_micros(&self, shift: &ClockShift) -> i64 {
        i64::try_from(self.origin.elapsed().as_micros())
            .unwrap_or(i64::MAX)
            .saturating_add(shift.micros())
    }

    /// Records a fresh `LastModifiedDate` this repository wrote or holds (a claim, a
    /// heartbeat, an attempt that is about to release the write lock): alive now.
    pub(super) fn note(&mut self, id: EventId, last_modified: DateTime<Utc>, shift: &ClockShift) {
        let now = self.now_micros(shift);
        self.seen.insert(
            id.to_string(),
            Seen {
                last_modified: format_ts(last_modified),
                since_micros: now,
                first_micros: now,
            },
        );
    }

    /// A lock wait failed: the time from the last look to the next one is blind.
    pub(super) fn lock_wait_failed(&mut self) {
        if self.restart_since.is_none() {
            self.restart_since = Some(self.last_look.unwrap_or_default());
        }
    }

    /// Takes one look at the `processing` rows and returns the ids observed silent for
    /// `stale_after`. `lock_wait` is how long the write lock took, when the look holds it;
    /// `None` for a look without the lock, which keeps no books.
    pub(super) fn look(
        &mut self,
        processing: Vec<(String, String)>,
        stale_after: Duration,
        lock_wait: Option<Duration>,
        shift: &ClockShift,
    ) -> Vec<String> {
        let now = self.now_micros(shift);
        if let Some(wait) = lock_wait {
            let real = self.origin.elapsed();
            let gap = self.last_look.map(|last| real.saturating_sub(last));
            let blind = if let Some(since) = self.restart_since.take() {
                Some(real.saturating_sub(since))
            } else if wait > stale_after / 3 {
                Some(wait)
            } else {
                gap.filter(|gap| *gap > stale_after / 2)
            };
            if let Some(blind) = blind {
                let blind = i64::try_from(blind.as_micros()).unwrap_or(i64::MAX);
                for seen in self.seen.values_mut() {
                    seen.since_micros = seen.since_micros.saturating_add(blind).min(now);
                }
            }
            self.last_look = Some(real);
        }
        let mut next = HashMap::with_capacity(processing.len());
        for (id, last_modified) in processing {
            let seen = match self.seen.remove(&id) {
                Some(seen) if seen.last_modified == last_modified => seen,
                _ => Seen {
                    last_modified,
                    since_micros: now,
                    first_micros: now,
                },
            };
            next.insert(id, seen);
        }
        self.seen = next;
        let stale_micros = i64::try_from(stale_after.as_micros()).unwrap_or(i64::MAX);
        let cap_micros = stale_micros.saturating_mul(SILENCE_CAP);
        let mut stale: Vec<String> = self
            .seen
            .iter()
            .filter(|(_, seen)| {
                now.saturating_sub(seen.since_micros) >= stale_micros
                    || now.saturating_sub(seen.first_micros) >= cap_micros
            })
            .map(|(id, _)| id.clone())
            .collect();
        stale.sort();
        stale
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::truncate_micros;
    use uuid::Uuid;

    const STALE: Duration = Duration::from_secs(30);

    fn rows(last_modified: &str) -> Vec<(String, String)> {
        vec![("a".to_string(), last_modified.to_string())]
    }

    #[test]
    fn silence_is_measured_from_the_first_look() {
        let shift = ClockShift::new();
        let mut l = Liveness::new();
        assert!(
            l.look(rows("t1"), STALE, Some(Duration::ZERO), &shift)
                .is_empty()
        );
        shift.advance(Duration::from_secs(29));
        assert!(
            l.look(rows("t1"), STALE, Some(Duration::ZERO), &shift)
                .is_empty()
        );
        shift.advance(Duration::from_secs(1));
        assert_eq!(
            l.look(rows("t1"), STALE, Some(Duration::ZERO), &shift),
            ["a"]
        );
        // A heartbeat (a new value) makes it live again.
        assert!(
            l.look(rows("t2"), STALE, Some(Duration::ZERO), &shift)
                .is_empty()
        );
    }

    #[test]
    fn a_wall_clock_step_changes_nothing() {
        let shift = ClockShift::new();
        let mut l = Liveness::new();
        assert!(
            l.look(rows("t1"), STALE, Some(Duration::ZERO), &shift)
                .is_empty()
        );
        shift.step_host_clock(chrono::Duration::hours(1));
        assert!(
            l.look(rows("t1"), STALE, Some(Duration::ZERO), &shift)
                .is_empty()
        );
    }

    #[test]
    fn blind_intervals_do_not_count_but_the_cap_does() {
        let shift = ClockShift::new();
        let mut l = Liveness::new();
        assert!(
            l.look(rows("t1"), STALE, Some(Duration::ZERO), &shift)
                .is_empty()
        );
        // Every look waited 11 s for the write lock (an attempt held it, and a claim cannot
        // beat meanwhile): blind each time, so silence does not accumulate from those waits;
        // but a row unchanged for three stale-after periods is stale all the same.
        let mut stale_after_secs = None;
        for step in 1..=20 {
            shift.advance(Duration::from_secs(10));
            let wait = Some(Duration::from_secs(11));
            if !l.look(rows("t1"), STALE, wait, &shift).is_empty() {
                stale_after_secs = Some(step * 10);
                break;
            }
        }
        assert_eq!(stale_after_secs, Some(90));
    }

    #[test]
    fn a_failed_lock_wait_is_blind_and_a_look_without_the_lock_keeps_it() {
        let shift = ClockShift::new();
        let mut l = Liveness::new();
        assert!(
            l.look(rows("t1"), STALE, Some(Duration::ZERO), &shift)
                .is_empty()
        );
        shift.advance(Duration::from_secs(25));
        l.lock_wait_failed();
        // `stats` looks without the lock: it neither clears the blind mark nor counts.
        shift.advance(Duration::from_secs(10));
        assert_eq!(l.look(rows("t1"), STALE, None, &shift), ["a"]);
        // The next look with the lock does not count the blind time (here real time, tiny:
        // the shift stands for time that passed while nobody could look).
        assert!(l.restart_since.is_some());
        l.look(rows("t1"), STALE, Some(Duration::ZERO), &shift);
        assert!(l.restart_since.is_none());
    }

    #[test]
    fn a_note_keeps_a_claim_alive() {
        let shift = ClockShift::new();
        let mut l = Liveness::new();
        let id = Uuid::now_v7();
        let t = truncate_micros(Utc::now());
        let rows = vec![(id.to_string(), format_ts(t))];
        assert!(
            l.look(rows.clone(), STALE, Some(Duration::ZERO), &shift)
                .is_empty()
        );
        shift.advance(Duration::from_secs(29));
        l.note(id, t, &shift);
        shift.advance(Duration::from_secs(29));
        assert!(l.look(rows, STALE, Some(Duration::ZERO), &shift).is_empty());
    }
}
