//! How one claim's rows are dealt to the workers that asked for them (a record at a time, none
//! beyond a worker's want), and the release of what no worker asked for.

use std::collections::VecDeque;

use outbox_persistence::{BeatOutcome, Claim, Fence, OutboxRepository};

use crate::metrics::Metrics;

/// What [`deal`] made of a claim: each worker's rows, and the rows no worker asked for.
#[derive(Debug, Default)]
pub(super) struct Dealt {
    pub(super) hands: Vec<Vec<Claim>>,
    /// Rows beyond every want, a record's rows together and in order, each group with the
    /// worker that holds its record's older rows (none when the whole record was left over):
    /// released unrun, or dealt after all if the release fails.
    pub(super) beyond: Vec<(Option<usize>, Vec<Claim>)>,
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
            dealt.beyond.push((Some(worker), cut));
        }
        left[worker] -= unit.len();
        dealt.hands[worker].extend(unit);
        next = worker + 1;
    }
    dealt
        .beyond
        .extend(units.into_iter().map(|unit| (None, unit)));
    dealt
}

/// Why rows claimed beyond every want are released.
const BEYOND_WANT: &str = "claimed beyond what its worker asked for: given back unrun";

/// Releases the rows claimed beyond every want in one statement (uncounted: none ran). If the
/// release fails it may still have landed (its reply lost), so a row is dealt after all only
/// once a fenced beat confirms it is still this claim (after which the release can no longer
/// apply), each record's rows in order up to the first that is not, to the worker holding its
/// record's older rows (a leftover record whole, in turn). A row not confirmed is left: released,
/// or gone stale and reclaimed (counted), never run twice.
pub(super) async fn release_beyond(
    repo: &dyn OutboxRepository,
    metrics: &Metrics,
    dealt: &mut Dealt,
) {
    if dealt.beyond.is_empty() {
        return;
    }
    let fences: Vec<Fence> = dealt
        .beyond
        .iter()
        .flat_map(|(_, unit)| unit.iter().map(|c| c.fence))
        .collect();
    let error = match repo.release_claims(fences.clone(), BEYOND_WANT).await {
        Ok(_) => {
            for claim in dealt.beyond.drain(..).flat_map(|(_, unit)| unit) {
                metrics.beyond_want(&claim.event.event_type, claim.reclaimed);
            }
            return;
        }
        Err(e) => e,
    };
    let beaten = match repo.heartbeat_many(fences).await {
        Ok(outcomes) => outcomes,
        Err(e) => {
            tracing::warn!(error = %error.chain(), beat_error = %e.chain(), "releasing rows claimed beyond the workers' wants failed and they could not be confirmed; leaving them to stale reclaim");
            dealt.beyond.clear();
            return;
        }
    };
    tracing::warn!(error = %error.chain(), "releasing rows claimed beyond the workers' wants failed; dealing the confirmed ones after all");
    let mut beaten = beaten.into_iter();
    let workers = dealt.hands.len();
    for (n, (owner, unit)) in std::mem::take(&mut dealt.beyond).into_iter().enumerate() {
        let mut confirmed = true;
        for mut claim in unit {
            match beaten.next() {
                Some(BeatOutcome::Beaten(fence)) if confirmed => {
                    claim.fence = fence;
                    dealt.hands[owner.unwrap_or(n % workers)].push(claim);
                }
                _ => confirmed = false,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use outbox_persistence::{Fence, MockOutboxRepository};

    use super::*;
    use crate::claims::tests::claim;

    /// Rows beyond every want go back in one statement; when that statement fails (it may have
    /// landed, its reply lost) a row is dealt only once a fenced beat confirms it, in record
    /// order up to the first that is not: never a row another worker may hold by now.
    #[tokio::test]
    async fn rows_beyond_the_wants_are_released_or_dealt_only_when_confirmed() {
        use outbox_persistence::BeatOutcome;
        let chain: Vec<Claim> = (0..4).map(|_| claim(3)).collect();
        let moved = |c: &Claim| Fence {
            id: c.fence.id,
            last_written: c.fence.last_written + chrono::Duration::seconds(1),
        };
        let mut released = MockOutboxRepository::new();
        released
            .expect_release_claims()
            .times(1)
            .withf(|fences, _| fences.len() == 2)
            .returning(|fences, _| {
                Ok(vec![
                    outbox_persistence::FenceOutcome::Written;
                    fences.len()
                ])
            });
        let mut dealt = deal(chain.clone().into_iter(), &[2]);
        release_beyond(&released, &Metrics::default(), &mut dealt).await;
        assert_eq!(dealt.hands, vec![chain[..2].to_vec()]);
        assert!(dealt.beyond.is_empty());

        let mut failed = MockOutboxRepository::new();
        failed.expect_release_claims().returning(|_, _| {
            Err(outbox_persistence::Error::Unavailable(
                sqlx::Error::PoolTimedOut,
            ))
        });
        let (third, fourth) = (moved(&chain[2]), moved(&chain[3]));
        // The third row is still this claim; the fourth is not (its release landed): the third
        // is dealt under its new fence, the fourth left alone.
        failed
            .expect_heartbeat_many()
            .times(1)
            .returning(move |_| Ok(vec![BeatOutcome::Beaten(third), BeatOutcome::Lost]));
        let mut dealt = deal(chain.clone().into_iter(), &[2]);
        release_beyond(&failed, &Metrics::default(), &mut dealt).await;
        let hand: Vec<_> = dealt.hands[0].iter().map(|c| c.fence).collect();
        assert_eq!(hand, vec![chain[0].fence, chain[1].fence, third]);
        assert!(!hand.contains(&fourth) && !hand.contains(&chain[3].fence));
        assert!(dealt.beyond.is_empty());
    }
}
