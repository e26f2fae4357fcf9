//! One claim statement for the pull workers that are idle at the same moment.
//!
//! A worker that wants rows asks the dispatcher's [`Claims`] for as many as its next attempt
//! runs (one, or a batch: see `docs/state-machine.md`, "Batched attempts"). When no claim is
//! under way it leads: it claims, in one call of [`OutboxRepository::claim_batch`], the rows
//! it wants and those of every worker that queued behind it meanwhile (with record chains when
//! they run batches), deals them out a record at a time (a record's rows to one worker; one
//! record to each worker in turn, so that every worker has one before any has two; nothing to
//! a worker when fewer were eligible), and passes the lead to the first worker that queued
//! while it claimed. So at most one claim statement per dispatcher runs at a time, its fixed
//! cost is shared, and concurrent claims no longer skip over each other's locked heads. Each
//! worker holds its attempt permit from before it asks until its last attempt ends, and rows
//! are claimed only for workers waiting for them; they are handed over in memory, and the
//! first attempt begins as soon as the worker is woken.

use std::collections::VecDeque;
use std::sync::Mutex;

use outbox_persistence::{Claim, ClaimPolicy, OutboxRepository, Scope};
use tokio::sync::oneshot;

use crate::metrics::Metrics;

mod deal;

use deal::{deal, release_beyond};

/// What a worker is told when it asks for a row.
#[derive(Debug)]
pub(crate) enum Reply {
    /// Rows claimed for this worker (at least one, at most as many as it asked for): start
    /// their attempt now.
    Claimed(Vec<Claim>),
    /// Nothing eligible now.
    Nothing,
    /// The claim failed; the leader got the error (and logs it); the others back off too.
    Failed(Option<outbox_persistence::Error>),
}

/// What the leader sends a queued worker.
enum Turn {
    Reply(Reply),
    /// Claim for yourself and those queued behind you.
    Lead,
}

/// A worker queued behind the leader, and how many rows it wants.
struct Follower {
    tx: oneshot::Sender<Turn>,
    want: usize,
}

#[derive(Default)]
struct Queue {
    /// A worker is claiming.
    leading: bool,
    waiting: VecDeque<Follower>,
}

/// The dispatcher's claims: one per pull-worker set (one scope).
pub(crate) struct Claims {
    queue: Mutex<Queue>,
    /// The most workers one statement serves (the number of workers, or
    /// `WorkerConfig::max_claim_batch`).
    max_workers: usize,
}

impl Claims {
    pub(crate) fn new(max_workers: usize) -> Self {
        Self {
            queue: Mutex::default(),
            max_workers: max_workers.clamp(1, outbox_persistence::MAX_CLAIM_BATCH),
        }
    }

    /// Up to `want` rows for the calling worker, claimed by it or by the worker leading when
    /// it asked. With `WorkerConfig::max_claim_batch` 1 every worker claims for itself,
    /// concurrently. Dropping this future while it waits passes on a lead it was handed; rows
    /// already claimed for it are left to stale reclaim (the pull worker never drops it).
    pub(crate) async fn claim(
        &self,
        repo: &dyn OutboxRepository,
        metrics: &Metrics,
        policy: ClaimPolicy,
        scope: &Scope,
        want: usize,
    ) -> Reply {
        let want = want.clamp(1, outbox_persistence::MAX_CLAIM_BATCH);
        if self.max_workers == 1 {
            metrics.claim_statement();
            let claimed = if want == 1 {
                repo.claim_next(policy, scope).await.map(Vec::from_iter)
            } else {
                repo.claim_chains(policy, scope, want, want - 1).await
            };
            return match claimed {
                Ok(claims) if claims.is_empty() => Reply::Nothing,
                Ok(claims) => Reply::Claimed(claims),
                Err(e) => Reply::Failed(Some(e)),
            };
        }
        let queued = {
            let mut queue = self.lock();
            if queue.leading {
                let (tx, rx) = oneshot::channel();
                queue.waiting.push_back(Follower { tx, want });
                Some(Waiting {
                    rx: Some(rx),
                    claims: self,
                })
            } else {
                queue.leading = true;
                None
            }
        };
        if let Some(mut waiting) = queued {
            match waiting.turn().await {
                Some(Turn::Reply(reply)) => return reply,
                Some(Turn::Lead) => {}
                // The leader went away without a word (it panicked): lead instead, unless
                // another worker already does.
                None => {
                    let mut queue = self.lock();
                    if queue.leading {
                        return Reply::Nothing;
                    }
                    queue.leading = true;
                }
            }
        }
        let lead = Lead { claims: self };
        metrics.claim_statement();
        lead.claim(repo, metrics, policy, scope, want).await
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A worker queued behind the leader. Dropped before its turn came (its future was dropped),
/// it passes on a lead it was handed, so the queue never waits for a leader that is gone.
struct Waiting<'a> {
    rx: Option<oneshot::Receiver<Turn>>,
    claims: &'a Claims,
}

impl Waiting<'_> {
    /// The leader's word; `None` when the leader went away without one.
    async fn turn(&mut self) -> Option<Turn> {
        let rx = self.rx.as_mut().expect("a turn is awaited once");
        let turn = rx.await.ok();
        self.rx = None;
        turn
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        // No send can succeed after `close`, and whatever was sent before is still there.
        rx.close();
        match rx.try_recv() {
            Ok(Turn::Lead) => drop(Lead {
                claims: self.claims,
            }),
            Ok(Turn::Reply(Reply::Claimed(claims))) => {
                for claim in claims {
                    tracing::error!(event_id = %claim.event.id, "a worker stopped waiting after a row was claimed for it; the row will be reclaimed when stale");
                }
            }
            _ => {}
        }
    }
}

/// The lead, passed on when dropped (also when the leader's future is dropped or panics).
struct Lead<'a> {
    claims: &'a Claims,
}

impl Lead<'_> {
    async fn claim(
        &self,
        repo: &dyn OutboxRepository,
        metrics: &Metrics,
        policy: ClaimPolicy,
        scope: &Scope,
        want: usize,
    ) -> Reply {
        let followers: Vec<Follower> = {
            let mut queue = self.claims.lock();
            // No row for a worker that stopped waiting.
            queue.waiting.retain(|follower| !follower.tx.is_closed());
            let n = queue.waiting.len().min(self.claims.max_workers - 1);
            queue.waiting.drain(..n).collect()
        };
        let wants: Vec<usize> = std::iter::once(want)
            .chain(followers.iter().map(|f| f.want))
            .collect();
        let total = wants
            .iter()
            .sum::<usize>()
            .min(outbox_persistence::MAX_CLAIM_BATCH);
        // Workers that run batches take record chains too: a record's next rows with its
        // head, where the heads leave room (docs/state-machine.md, "Record chains").
        let chain = wants.iter().max().map_or(0, |most| most - 1);
        let claimed = if chain == 0 {
            repo.claim_batch(policy, scope, total).await
        } else {
            repo.claim_chains(policy, scope, total, chain).await
        };
        match claimed {
            Ok(claims) => {
                let mut dealt = deal(claims.into_iter(), &wants);
                release_beyond(repo, metrics, &mut dealt).await;
                let mut dealt = dealt.hands.into_iter();
                let mine = dealt.next().unwrap_or_default();
                for (follower, claims) in followers.into_iter().zip(dealt) {
                    let reply = if claims.is_empty() {
                        Reply::Nothing
                    } else {
                        Reply::Claimed(claims)
                    };
                    if let Err(Turn::Reply(Reply::Claimed(claims))) =
                        follower.tx.send(Turn::Reply(reply))
                    {
                        // Only a worker that panicked stops listening; its rows go stale and
                        // are reclaimed like any dead worker's.
                        for claim in claims {
                            tracing::error!(event_id = %claim.event.id, "a claimed row's worker went away before it was handed over; the row will be reclaimed when stale");
                        }
                    }
                }
                if mine.is_empty() {
                    Reply::Nothing
                } else {
                    Reply::Claimed(mine)
                }
            }
            Err(e) => {
                for follower in followers {
                    let _ = follower.tx.send(Turn::Reply(Reply::Failed(None)));
                }
                Reply::Failed(Some(e))
            }
        }
    }
}

impl Drop for Lead<'_> {
    fn drop(&mut self) {
        let mut queue = self.claims.lock();
        while let Some(next) = queue.waiting.pop_front() {
            if next.tx.send(Turn::Lead).is_ok() {
                return;
            }
        }
        queue.leading = false;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use outbox_persistence::{EventStatus, Fence, MockOutboxRepository, OutboxEvent, RecordKey};

    use super::*;

    pub(super) fn claim(n: usize) -> Claim {
        let id = outbox_persistence::new_event_id();
        let now = chrono::Utc::now();
        Claim {
            fence: Fence {
                id,
                last_written: now,
            },
            reclaimed: false,
            event: OutboxEvent {
                id,
                event_type: "t".into(),
                payload: "{}".into(),
                status: EventStatus::Processing,
                retry_count: 0,
                record_key: Some(RecordKey::from_stored(format!("Lead:{n}"))),
                created_date: now,
                last_modified_date: now,
                last_error: None,
            },
        }
    }

    /// A repository whose claim takes 20 ms and has `available` rows in all, and that records
    /// every batch size it was asked for.
    fn repo(available: usize, sizes: Arc<Mutex<Vec<usize>>>) -> MockOutboxRepository {
        let left = Arc::new(AtomicUsize::new(available));
        let mut repo = MockOutboxRepository::new();
        let take = move |max: usize| {
            sizes.lock().unwrap().push(max);
            let n = max.min(left.load(Ordering::SeqCst));
            left.fetch_sub(n, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(20));
            Ok((0..n).map(claim).collect())
        };
        let chains = take.clone();
        repo.expect_claim_batch()
            .returning(move |_, _, max| take(max));
        repo.expect_claim_chains()
            .returning(move |_, _, max, _| chains(max));
        repo
    }

    async fn ask_all(claims: Arc<Claims>, repo: Arc<MockOutboxRepository>, n: usize) -> Vec<Reply> {
        ask(claims, repo, &vec![1; n]).await
    }

    /// Worker `i` asks for `wants[i]` rows; all ask at once.
    async fn ask(
        claims: Arc<Claims>,
        repo: Arc<MockOutboxRepository>,
        wants: &[usize],
    ) -> Vec<Reply> {
        let tasks: Vec<_> = wants
            .iter()
            .map(|&want| {
                let (claims, repo) = (claims.clone(), repo.clone());
                tokio::spawn(async move {
                    let scope = Scope::All;
                    claims
                        .claim(
                            repo.as_ref(),
                            &Metrics::default(),
                            ClaimPolicy::new(Duration::from_secs(30), Duration::from_secs(1), 5),
                            &scope,
                            want,
                        )
                        .await
                })
            })
            .collect();
        let mut replies = Vec::new();
        for task in tasks {
            replies.push(task.await.unwrap());
        }
        replies
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn workers_that_ask_together_share_a_claim_statement() {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let repo = Arc::new(repo(100, sizes.clone()));
        let claims = Arc::new(Claims::new(8));
        let replies = ask_all(claims.clone(), repo, 8).await;
        let ids: std::collections::HashSet<_> = replies
            .iter()
            .map(|r| match r {
                Reply::Claimed(c) if c.len() == 1 => c[0].event.id,
                other => panic!("every worker gets a row, got {other:?}"),
            })
            .collect();
        assert_eq!(ids.len(), 8, "each row goes to one worker");
        let sizes = sizes.lock().unwrap().clone();
        assert_eq!(
            sizes.iter().sum::<usize>(),
            8,
            "one row asked for per worker: {sizes:?}"
        );
        assert!(
            sizes.len() < 8,
            "the workers that queued behind the first claim shared one: {sizes:?}"
        );
        assert!(!claims.lock().leading, "the lead ends with the last claim");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn workers_beyond_the_eligible_rows_are_told_nothing() {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let repo = Arc::new(repo(3, sizes));
        let claims = Arc::new(Claims::new(8));
        let replies = ask_all(claims, repo, 8).await;
        let claimed = replies
            .iter()
            .filter(|r| matches!(r, Reply::Claimed(_)))
            .count();
        let nothing = replies
            .iter()
            .filter(|r| matches!(r, Reply::Nothing))
            .count();
        assert_eq!((claimed, nothing), (3, 5));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_failed_claim_reaches_the_leader_and_backs_off_the_batch() {
        let mut repo = MockOutboxRepository::new();
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        repo.expect_claim_batch().returning(move |_, _, _| {
            counted.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(20));
            Err(outbox_persistence::Error::Unavailable(
                outbox_persistence::sqlx::Error::PoolTimedOut,
            ))
        });
        let claims = Arc::new(Claims::new(8));
        let replies = ask_all(claims.clone(), Arc::new(repo), 8).await;
        let errors = replies
            .iter()
            .filter(|r| matches!(r, Reply::Failed(Some(_))))
            .count();
        assert_eq!(
            errors,
            calls.load(Ordering::SeqCst),
            "each statement's error reaches its leader once"
        );
        assert!(replies.iter().all(|r| matches!(r, Reply::Failed(_))));
        assert!(!claims.lock().leading);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_batch_never_asks_for_more_than_the_workers() {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let repo = Arc::new(repo(100, sizes.clone()));
        let claims = Arc::new(Claims::new(3));
        ask_all(claims, repo, 12).await;
        let sizes = sizes.lock().unwrap().clone();
        assert_eq!(sizes.iter().sum::<usize>(), 12);
        assert!(sizes.iter().all(|&n| n <= 3), "{sizes:?}");
        assert!(
            sizes.contains(&3),
            "the queued workers filled batches: {sizes:?}"
        );
    }

    #[test]
    fn a_worker_that_stops_waiting_passes_on_the_lead_it_was_handed() {
        let claims = Claims::new(8);
        claims.lock().leading = true;
        let (tx, rx) = oneshot::channel();
        let waiting = Waiting {
            rx: Some(rx),
            claims: &claims,
        };
        tx.send(Turn::Lead).ok().expect("the worker still waits");
        drop(waiting);
        assert!(
            !claims.lock().leading,
            "the lead was passed on (to nobody), not lost with the worker"
        );

        // A worker that stopped waiting before its turn is passed over.
        claims.lock().leading = true;
        let (gone, gone_rx) = oneshot::channel();
        let (next, mut next_rx) = oneshot::channel();
        claims.lock().waiting.extend([
            Follower { tx: gone, want: 1 },
            Follower { tx: next, want: 1 },
        ]);
        drop(Waiting {
            rx: Some(gone_rx),
            claims: &claims,
        });
        drop(Lead { claims: &claims });
        assert!(matches!(next_rx.try_recv(), Ok(Turn::Lead)));
        assert!(claims.lock().leading, "the next worker leads now");
    }

    #[tokio::test]
    async fn no_row_is_claimed_for_a_worker_that_stopped_waiting() {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let repo = repo(100, sizes.clone());
        let claims = Claims::new(8);
        claims.lock().leading = true;
        let (gone, gone_rx) = oneshot::channel();
        let (waiting, mut waiting_rx) = oneshot::channel();
        claims.lock().waiting.extend([
            Follower { tx: gone, want: 1 },
            Follower {
                tx: waiting,
                want: 1,
            },
        ]);
        drop(gone_rx);
        let scope = Scope::All;
        let lead = Lead { claims: &claims };
        let mine = lead
            .claim(
                &repo,
                &Metrics::default(),
                ClaimPolicy::new(Duration::from_secs(30), Duration::from_secs(1), 5),
                &scope,
                1,
            )
            .await;
        drop(lead);
        assert!(matches!(mine, Reply::Claimed(_)));
        assert!(matches!(
            waiting_rx.try_recv(),
            Ok(Turn::Reply(Reply::Claimed(_)))
        ));
        assert_eq!(
            *sizes.lock().unwrap(),
            vec![2],
            "the leader and the one still waiting"
        );
        assert!(!claims.lock().leading);
    }

    /// Workers that want batches get what they asked for from one statement while rows last,
    /// dealt one at a time: with too few rows, every worker has one before any has two.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn batches_are_dealt_one_row_to_each_worker_in_turn() {
        let wants = [4, 1, 3];
        let claims: Vec<Claim> = (0..5).map(claim).collect();
        let dealt = deal(claims.clone().into_iter(), &wants).hands;
        let sizes: Vec<usize> = dealt.iter().map(Vec::len).collect();
        assert_eq!(sizes, vec![2, 1, 2]);
        assert_eq!(
            dealt[0][0], claims[0],
            "the leader's first row is the oldest"
        );
        let dealt = deal(claims.into_iter(), &[1, 1]);
        assert_eq!(dealt.hands.iter().map(Vec::len).sum::<usize>(), 2);
        assert_eq!(
            dealt.beyond.len(),
            3,
            "none dropped: left for release, a record whole"
        );
        // A record's rows go to one worker, in order.
        let chain: Vec<Claim> = (0..3).map(|_| claim(7)).collect();
        let dealt = deal(chain.clone().into_iter().chain([claim(8)]), &[3, 2]).hands;
        assert_eq!(dealt[0], chain);
        assert_eq!(dealt[1].len(), 1);
        // A worker that asks for one (its handlers are slow) takes a record that fits rather
        // than the long chain; a chain longer than any want is cut, the rest left for release.
        let long: Vec<Claim> = (0..5).map(|_| claim(9)).collect();
        let single = claim(10);
        let dealt = deal(long.clone().into_iter().chain([single.clone()]), &[1, 8]);
        assert_eq!(dealt.hands, vec![vec![single], long.clone()]);
        assert!(dealt.beyond.is_empty());
        let dealt = deal(long.clone().into_iter(), &[1, 3]);
        assert_eq!(dealt.hands, vec![Vec::new(), long[..3].to_vec()]);
        assert_eq!(dealt.beyond, vec![(Some(1), long[3..].to_vec())]);

        let sizes = Arc::new(Mutex::new(Vec::new()));
        let repo = Arc::new(repo(100, sizes.clone()));
        let replies = ask(Arc::new(Claims::new(8)), repo, &[16, 16, 16, 16]).await;
        for reply in &replies {
            assert!(
                matches!(reply, Reply::Claimed(c) if c.len() == 16),
                "{reply:?}"
            );
        }
        assert_eq!(sizes.lock().unwrap().iter().sum::<usize>(), 64);
    }

    /// A batch of one restores the claim before batches: each worker calls `claim_next`
    /// itself, past the queue (which would serialize them), so claims can run concurrently
    /// (mockall serializes calls into a mock, so this checks the path, not the overlap).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn with_a_batch_of_one_every_worker_claims_for_itself() {
        let mut repo = MockOutboxRepository::new();
        repo.expect_claim_next()
            .times(4)
            .returning(|_, _| Ok(Some(claim(0))));
        repo.expect_claim_batch().never();
        let claims = Arc::new(Claims::new(1));
        let replies = ask_all(claims.clone(), Arc::new(repo), 4).await;
        assert!(replies.iter().all(|r| matches!(r, Reply::Claimed(_))));
        let queue = claims.lock();
        assert!(!queue.leading && queue.waiting.is_empty(), "nobody queued");
    }
}
