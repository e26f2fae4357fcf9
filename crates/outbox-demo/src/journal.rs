//! The attempt journal and the work runs, kept in the side store ([`MailSink`]) outside every
//! attempt transaction, so that a rolled-back or killed attempt still leaves its rows behind.
//!
//! - `DemoAttemptJournal`: the slow and the poison handlers write `start` when they begin and
//!   `finish`, `dropped` (their future was dropped: the claim was lost, or a shutdown cancelled
//!   the attempt) or `died` (a poison event is about to abort the process) when they end; the
//!   fault suite writes `killed` after it SIGKILLed a process (with the event and `RetryCount`
//!   of the held send it aimed at, if it did). A welcome email with a held send writes `sent`
//!   after the send, before its attempt waits to commit. Rows are ordered by the store's
//!   own sequence, never by a host clock, so a worker whose clock runs behind cannot blur them.
//! - `DemoWorkRun`: one row per `outbox-demo work` process (and per demo run), written before
//!   its workers start, updated with its counters every few seconds and completed when it exits.
//!   A run never completed is a process that died; its counters are those it last recorded.
//!
//! From these, verification tells a handler that ran again while it still ran (a claim taken
//! over from a live worker) from a redelivery after its process died.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use anyhow::Result;
use outbox_events::MetricsSnapshot;
use outbox_persistence::with_conn;
use serde::Serialize;

use super::sink::MailSink;

/// What a journal row says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mark {
    /// A journaled handler began an attempt.
    Start,
    /// It ran to its end.
    Finish,
    /// Its future was dropped before its end while its process lived on (the claim was lost,
    /// or a shutdown cancelled the attempt).
    Dropped,
    /// Its process is about to abort (a poison event): every attempt of that process dies.
    Died,
    /// The fault suite SIGKILLed the process (written by `cargo xtask faults`); with an event
    /// id when the kill was aimed at that event's held send (see [`Mark::Sent`]).
    Killed,
    /// A welcome email's held send happened; its attempt waits before it commits.
    Sent,
}

impl Mark {
    /// The text stored in `Mark`.
    pub fn as_str(self) -> &'static str {
        match self {
            Mark::Start => "start",
            Mark::Finish => "finish",
            Mark::Dropped => "dropped",
            Mark::Died => "died",
            Mark::Killed => "killed",
            Mark::Sent => "sent",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        [
            Mark::Start,
            Mark::Finish,
            Mark::Dropped,
            Mark::Died,
            Mark::Killed,
            Mark::Sent,
        ]
        .into_iter()
        .find(|m| m.as_str() == text)
    }
}

/// One journal row.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The store's sequence: the journal's only order.
    pub seq: i64,
    /// What happened.
    pub mark: Mark,
    /// The event (empty for `killed`).
    pub event_id: String,
    /// The attempt's `RetryCount` when it was claimed.
    pub retry_count: i32,
    /// The process.
    pub pid: i64,
}

/// One `outbox-demo work` process (or demo run).
#[derive(Debug, Clone, Serialize)]
pub struct WorkRun {
    /// The process.
    pub pid: i64,
    /// Whether it exited normally (otherwise the counters are the last it recorded).
    pub completed: bool,
    /// Rows it claimed.
    pub claimed: i64,
    /// Attempts it abandoned because their claim was taken over or finished elsewhere.
    pub lost_claims: i64,
    /// Its claims of stale rows.
    pub stale_reclaims: i64,
    /// Attempts a hard shutdown cancelled.
    pub cancelled: i64,
}

/// How often, and after which first pause, a journal write is tried before it is given up.
const JOURNAL_TRIES: u32 = 8;
const JOURNAL_FIRST_BACKOFF: Duration = Duration::from_millis(100);

impl MailSink {
    /// Writes one journal row for this process, retried with backoff (the side store may be
    /// briefly away: a cut connection, a restarting server).
    pub async fn journal(&self, mark: Mark, event_id: &str, retry_count: i32) -> Result<()> {
        let pid = i64::from(std::process::id());
        let mut backoff = JOURNAL_FIRST_BACKOFF;
        let mut tries = 0;
        loop {
            let written = with_conn!(&self.db, |pool| {
                outbox_persistence::statement::query(
                    "INSERT INTO DemoAttemptJournal (Mark, EventId, RetryCount, Pid)
                     VALUES ($1, $2, $3, $4)",
                )
                .bind(mark.as_str())
                .bind(event_id)
                .bind(retry_count)
                .bind(pid)
                .execute(pool)
                .await
                .map(|_| ())
            });
            tries += 1;
            match written {
                Ok(()) => return Ok(()),
                Err(e) if tries >= JOURNAL_TRIES => return Err(e.into()),
                Err(e) => {
                    tracing::debug!(error = %e, "journal write failed; trying again");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
            }
        }
    }

    /// Every journal row, in the store's order.
    pub async fn journal_entries(&self) -> Result<Vec<Entry>> {
        let rows: Vec<(i64, String, String, i32, i64)> = with_conn!(&self.db, |pool| {
            outbox_persistence::statement::query_as(
                "SELECT Seq, Mark, EventId, RetryCount, Pid FROM DemoAttemptJournal ORDER BY Seq",
            )
            .fetch_all(pool)
            .await
        })?;
        rows.into_iter()
            .map(|(seq, mark, event_id, retry_count, pid)| {
                Ok(Entry {
                    seq,
                    mark: Mark::parse(&mark)
                        .ok_or_else(|| anyhow::anyhow!("unknown journal mark {mark:?}"))?,
                    event_id,
                    retry_count,
                    pid,
                })
            })
            .collect()
    }

    /// Records that this process starts working in `mode`; returns the run's id.
    pub async fn run_started(&self, mode: &str) -> Result<i64> {
        Ok(with_conn!(&self.db, |pool| {
            outbox_persistence::statement::query_scalar(
                "INSERT INTO DemoWorkRun (Pid, Mode) VALUES ($1, $2) RETURNING RunId",
            )
            .bind(i64::from(std::process::id()))
            .bind(mode)
            .fetch_one(pool)
            .await
        })?)
    }

    /// Completes run `run_id` with the process's counters (it exits normally).
    pub async fn run_completed(&self, run_id: i64, m: &MetricsSnapshot) -> Result<()> {
        self.update_run(run_id, m, true).await
    }

    /// Records the counters of run `run_id` so far (the process works on).
    pub async fn run_progress(&self, run_id: i64, m: &MetricsSnapshot) -> Result<()> {
        self.update_run(run_id, m, false).await
    }

    async fn update_run(&self, run_id: i64, m: &MetricsSnapshot, completed: bool) -> Result<()> {
        let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        with_conn!(&self.db, |pool| {
            outbox_persistence::statement::query(
                "UPDATE DemoWorkRun SET Completed = $6, Claimed = $2, LostClaims = $3,
                   StaleReclaims = $4, Cancelled = $5
                 WHERE RunId = $1",
            )
            .bind(run_id)
            .bind(n(m.claimed))
            .bind(n(m.lost_claims))
            .bind(n(m.stale_reclaims))
            .bind(n(m.cancelled))
            .bind(i64::from(completed))
            .execute(pool)
            .await
            .map(|_| ())
        })?;
        Ok(())
    }

    /// Every work run.
    pub async fn work_runs(&self) -> Result<Vec<WorkRun>> {
        let rows: Vec<(i64, i64, i64, i64, i64, i64)> = with_conn!(&self.db, |pool| {
            outbox_persistence::statement::query_as(
                "SELECT Pid, Completed, Claimed, LostClaims, StaleReclaims, Cancelled
                 FROM DemoWorkRun ORDER BY RunId",
            )
            .fetch_all(pool)
            .await
        })?;
        Ok(rows
            .into_iter()
            .map(|r| WorkRun {
                pid: r.0,
                completed: r.1 != 0,
                claimed: r.2,
                lost_claims: r.3,
                stale_reclaims: r.4,
                cancelled: r.5,
            })
            .collect())
    }
}

/// A journaled handler run: `start` when created, `finish` or `died` when told, `dropped` when
/// dropped before either (its attempt was interrupted while the process lived on).
pub struct JournaledRun {
    sink: MailSink,
    event_id: String,
    retry_count: i32,
    ended: bool,
}

/// How often a run's end is tried before its error is returned.
const END_TRIES: u32 = 5;

impl JournaledRun {
    /// Journals the start of an attempt of `event_id` at `retry_count`.
    pub async fn start(sink: &MailSink, event_id: String, retry_count: i32) -> Result<Self> {
        sink.journal(Mark::Start, &event_id, retry_count).await?;
        Ok(Self {
            sink: sink.clone(),
            event_id,
            retry_count,
            ended: false,
        })
    }

    /// Journals how the run ended (`finish` or `died`), retried a few times: the run has
    /// ended whatever the side store says, and a lost end (a cut connection) would leave the
    /// journal showing it open, then superseded by the event's next attempt while its process
    /// lived. A repeated end (a retry after a reply that was lost) is ignored by the analysis.
    pub async fn end(mut self, mark: Mark) -> Result<()> {
        self.ended = true;
        let mut backoff = std::time::Duration::from_millis(50);
        let mut tries = 1;
        loop {
            match self
                .sink
                .journal(mark, &self.event_id, self.retry_count)
                .await
            {
                Ok(()) => return Ok(()),
                Err(e) if tries == END_TRIES => return Err(e),
                Err(_) => {
                    tokio::time::sleep(backoff).await;
                    backoff *= 2;
                    tries += 1;
                }
            }
        }
    }
}

impl Drop for JournaledRun {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        // The attempt's future was dropped (a lost claim or a cancelled attempt). The row is
        // written by a task of its own; its sequence comes a little after the drop, which
        // only ever makes the run look longer, never shorter.
        let (sink, event_id, retry_count) = (
            self.sink.clone(),
            std::mem::take(&mut self.event_id),
            self.retry_count,
        );
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(e) = sink.journal(Mark::Dropped, &event_id, retry_count).await {
                    tracing::warn!(error = %e, "could not journal a dropped attempt");
                }
            });
        }
    }
}

/// A journaled run that another run of its event followed while it had not ended, and that
/// never ended: it died with its process.
#[derive(Debug, Clone, Serialize)]
pub struct Superseded {
    /// The event.
    pub event_id: String,
    /// The process of the earlier run.
    pub pid: i64,
    /// The earlier run's `RetryCount`.
    pub retry_count: i32,
    /// Whether the journal shows that process dead (`died` or `killed`) before the later run
    /// started. The fault suite, which journals every kill, requires it.
    pub death_before_reclaim: bool,
    /// When it was not: the journal of the event and of its process's deaths
    /// (`seq mark RetryCount pid`), for the report.
    pub journal: Vec<String>,
}

/// What the journal shows.
#[derive(Debug, Clone, Default, Serialize)]
pub struct JournalFindings {
    /// Journaled runs.
    pub runs: usize,
    /// Runs that went on after another run of their event had started (or a second start of
    /// the same attempt by the same process): a handler that ran twice at once.
    pub ran_twice: usize,
    /// Runs that died with their process and were followed by another run.
    pub superseded: Vec<Superseded>,
    /// Processes that aborted on a poison event (`died` rows; a process dies once, a `died` row
    /// repeated after a lost reply counts once).
    pub poison_deaths: usize,
    /// Their process ids.
    pub poisoned_pids: BTreeSet<i64>,
}

struct Run<'a> {
    event_id: &'a str,
    retry_count: i32,
    pid: i64,
    start: i64,
    ended: bool,
    next_start: Option<i64>,
}

/// Reads the journal in its own order. A run still open when another run of its event starts
/// either ends later (it kept running: `ran_twice`) or never (it died: `superseded`).
pub fn analyse(entries: &[Entry]) -> JournalFindings {
    let mut runs: Vec<Run> = Vec::new();
    let mut open: HashMap<(&str, i32, i64), usize> = HashMap::new();
    let mut open_by_event: HashMap<&str, Vec<usize>> = HashMap::new();
    let mut deaths: HashMap<i64, Vec<i64>> = HashMap::new();
    let mut findings = JournalFindings::default();
    for e in entries {
        let key = (e.event_id.as_str(), e.retry_count, e.pid);
        match e.mark {
            Mark::Start => {
                let others = open_by_event.entry(key.0).or_default();
                for &i in others.iter() {
                    runs[i].next_start.get_or_insert(e.seq);
                }
                if open.contains_key(&key) {
                    findings.ran_twice += 1;
                }
                others.push(runs.len());
                open.insert(key, runs.len());
                runs.push(Run {
                    event_id: key.0,
                    retry_count: e.retry_count,
                    pid: e.pid,
                    start: e.seq,
                    ended: false,
                    next_start: None,
                });
            }
            Mark::Finish | Mark::Dropped | Mark::Died => {
                if let Some(i) = open.remove(&key) {
                    runs[i].ended = true;
                    if let Some(list) = open_by_event.get_mut(key.0) {
                        list.retain(|j| *j != i);
                    }
                }
                if e.mark == Mark::Died {
                    findings.poisoned_pids.insert(e.pid);
                    deaths.entry(e.pid).or_default().push(e.seq);
                }
            }
            Mark::Killed => deaths.entry(e.pid).or_default().push(e.seq),
            Mark::Sent => {}
        }
    }
    (findings.runs, findings.poison_deaths) = (runs.len(), findings.poisoned_pids.len());
    for run in &runs {
        let Some(next) = run.next_start else {
            continue;
        };
        if run.ended {
            findings.ran_twice += 1;
        } else {
            let died = deaths
                .get(&run.pid)
                .is_some_and(|seqs| seqs.iter().any(|s| *s > run.start && *s < next));
            let journal = if died {
                Vec::new()
            } else {
                entries
                    .iter()
                    .filter(|e| {
                        e.event_id == run.event_id
                            || (e.pid == run.pid && matches!(e.mark, Mark::Died | Mark::Killed))
                    })
                    .map(|e| format!("{} {:?} {} {}", e.seq, e.mark, e.retry_count, e.pid))
                    .collect()
            };
            findings.superseded.push(Superseded {
                event_id: run.event_id.to_string(),
                pid: run.pid,
                retry_count: run.retry_count,
                death_before_reclaim: died,
                journal,
            });
        }
    }
    findings
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(rows: &[(Mark, &str, i32, i64)]) -> Vec<Entry> {
        rows.iter()
            .enumerate()
            .map(|(i, (mark, event, retry_count, pid))| Entry {
                seq: i as i64 + 1,
                mark: *mark,
                event_id: event.to_string(),
                retry_count: *retry_count,
                pid: *pid,
            })
            .collect()
    }

    #[test]
    fn runs_one_after_another_are_fine() {
        let f = analyse(&entries(&[
            (Mark::Start, "e", 0, 1),
            (Mark::Dropped, "e", 0, 1),
            (Mark::Start, "e", 1, 2),
            (Mark::Finish, "e", 1, 2),
        ]));
        assert_eq!((f.runs, f.ran_twice, f.superseded.len()), (2, 0, 0));
    }

    #[test]
    fn a_run_taken_over_while_it_ran_is_counted() {
        // Taken over, then noticed: the earlier run ends after the later one began.
        let f = analyse(&entries(&[
            (Mark::Start, "e", 0, 1),
            (Mark::Start, "e", 1, 2),
            (Mark::Dropped, "e", 0, 1),
            (Mark::Finish, "e", 1, 2),
        ]));
        assert_eq!((f.ran_twice, f.superseded.len()), (1, 0));
        // The same attempt started twice by one process.
        let f = analyse(&entries(&[
            (Mark::Start, "e", 0, 1),
            (Mark::Start, "e", 0, 1),
        ]));
        assert!(f.ran_twice >= 1);
    }

    #[test]
    fn a_run_that_died_is_superseded_and_its_death_ordered() {
        let f = analyse(&entries(&[
            (Mark::Start, "e", 0, 1),
            (Mark::Killed, "", 0, 1),
            (Mark::Start, "e", 1, 2),
            (Mark::Start, "f", 0, 3),
            (Mark::Start, "f", 1, 4),
            (Mark::Killed, "", 0, 3),
            (Mark::Finish, "e", 1, 2),
            (Mark::Finish, "f", 1, 4),
        ]));
        assert_eq!(f.ran_twice, 0);
        let by_event: HashMap<&str, bool> = f
            .superseded
            .iter()
            .map(|s| (s.event_id.as_str(), s.death_before_reclaim))
            .collect();
        assert!(by_event["e"], "killed before the reclaim");
        assert!(!by_event["f"], "killed only after the reclaim");
    }

    #[test]
    fn a_poison_death_explains_the_other_runs_of_its_process() {
        let f = analyse(&entries(&[
            (Mark::Start, "slow", 0, 1),
            (Mark::Start, "poison", 0, 1),
            (Mark::Died, "poison", 0, 1),
            (Mark::Start, "poison", 1, 2),
            (Mark::Start, "slow", 1, 2),
            (Mark::Died, "poison", 1, 2),
        ]));
        assert_eq!((f.ran_twice, f.poison_deaths), (0, 2));
        assert_eq!(f.superseded.len(), 1);
        assert!(f.superseded[0].death_before_reclaim);
    }

    #[test]
    fn a_death_journaled_twice_is_one_death() {
        // The first `died` landed with its reply lost, and the retry wrote it again.
        let f = analyse(&entries(&[
            (Mark::Start, "poison", 0, 1),
            (Mark::Died, "poison", 0, 1),
            (Mark::Died, "poison", 0, 1),
            (Mark::Start, "poison", 1, 2),
            (Mark::Died, "poison", 1, 2),
        ]));
        assert_eq!((f.ran_twice, f.poison_deaths), (0, 2));
    }
}
