//! How one claim's rows are dealt to the workers that asked for them (a record at a time, none
//! beyond a worker's want), and the release of what no worker asked for.

use std::collections::VecDeque;

use outbox_persistence::{Claim, OutboxRepository};

use crate::metrics::Metrics;

/// What [`deal`] made of a claim: each worker's rows, and the rows no worker asked for.
#[derive(Debug, Default)]
pub(super) struct Dealt {
    pub(super) hands: Vec<Vec<Claim>>,
    /// Rows beyond every want, each with the worker that holds its record's older rows (none
    /// when the whole record was left over): released unrun, or handed to that worker if the
    /// release fails.
    pub(super) beyond: Vec<(Option<usize>, Claim)>,
}

/// Deals `claims` out to workers that want `wants[i]` rows each: one record's rows (its head
/// and its chain, in order) to one worker, and a record (or unkeyed row) to each worker in
/// turn, so that every worker has a record before any has two. A worker takes the first record
/// that fits what it still wants; when none fits, the first record goes to the worker that
/// still wants the most, cut to that size: no worker is
/// dealt more than it asked for, so a worker whose handlers are slow (it asks for few) never
/// holds a long chain. What is cut off, a chain's newer rows, is left for the leader to release
/// (issue 36: a slow handler never holds rows another worker could run).
pub(super) fn deal(claims: impl Iterator<Item = Claim>, wants: &[usize]) -> Dealt {
    let mut units: VecDeque<Vec<Claim>> = VecDeque::new();
    let mut unit_of: std::collections::HashMap<outbox_persistence::RecordKey, usize> =
        std::collections::HashMap::new();
    for claim in claims {
        match &claim.event.record_key {
            Some(key) => match unit_of.get(key) {
                Some(&unit) => units[unit].push(claim),
                None => {
                    unit_of.insert(key.clone(), units.len());
                    units.push_back(vec![claim]);
                }
            },
            None => units.push_back(vec![claim]),
        }
    }
    let mut dealt = Dealt {
        hands: wants.iter().map(|_| Vec::new()).collect(),
        beyond: Vec::new(),
    };
    let mut left = wants.to_vec();
    let mut next = 0;
    while !units.is_empty() {
        let Some(worker) = (0..wants.len())
            .map(|i| (next + i) % wants.len())
            .find(|&i| left[i] > 0)
        else {
            break;
        };
        // The first record that fits what it still wants; when none does, the first record
        // goes to the worker that still wants the most (the first in turn of those), cut to it.
        let (worker, pick) = match units.iter().position(|u| u.len() <= left[worker]) {
            Some(pick) => (worker, pick),
            None => {
                let roomiest = (0..wants.len())
                    .map(|i| (next + i) % wants.len())
                    .min_by_key(|&i| std::cmp::Reverse(left[i]))
                    .unwrap_or(worker);
                (roomiest, 0)
            }
        };
        let mut unit = units.remove(pick).expect("a unit");
        if unit.len() > left[worker] {
            let cut = unit.split_off(left[worker]);
            dealt
                .beyond
                .extend(cut.into_iter().map(|c| (Some(worker), c)));
        }
        left[worker] -= unit.len();
        dealt.hands[worker].extend(unit);
        next = worker + 1;
    }
    dealt
        .beyond
        .extend(units.into_iter().flatten().map(|c| (None, c)));
    dealt
}

/// Why rows claimed beyond every want are released.
const BEYOND_WANT: &str = "claimed beyond what its worker asked for: given back unrun";

/// Releases the rows claimed beyond every want in one statement (uncounted: none ran). If the
/// release fails they are dealt after all, each to the worker holding its record's older rows
/// (or in turn), rather than left to go stale and be counted as a dead attempt.
pub(super) async fn release_beyond(
    repo: &dyn OutboxRepository,
    metrics: &Metrics,
    dealt: &mut Dealt,
) {
    if dealt.beyond.is_empty() {
        return;
    }
    let fences = dealt.beyond.iter().map(|(_, c)| c.fence).collect();
    match repo.release_claims(fences, BEYOND_WANT).await {
        Ok(_) => {
            for (_, claim) in dealt.beyond.drain(..) {
                metrics.beyond_want(&claim.event.event_type, claim.reclaimed);
            }
        }
        Err(e) => {
            tracing::warn!(error = %e.chain(), rows = dealt.beyond.len(), "releasing rows claimed beyond the workers' wants failed; dealing them after all");
            let workers = dealt.hands.len();
            for (n, (owner, claim)) in dealt.beyond.drain(..).enumerate() {
                dealt.hands[owner.unwrap_or(n % workers)].push(claim);
            }
        }
    }
}
