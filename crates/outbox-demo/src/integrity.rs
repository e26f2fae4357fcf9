//! The integrity checks of a run with several processes, read from the side store: no claim
//! lost by a process that lived, no handler run twice for one attempt, and poison events ended
//! `failed` with their records' later events run. A process that died (SIGKILL, a poison
//! abort) explains a rerun of what it was doing; nothing else does.

use std::collections::HashMap;

use anyhow::Result;
use outbox_persistence::WORKER_DIED;
use serde::Serialize;

use super::handlers::is_poison;
use super::journal::{self, JournalFindings, WorkRun};
use super::sink::MailSink;
use super::verify::{Check, EventRow, check};

/// What the integrity checks read.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Integrity {
    /// Claims the processes lost while they lived (the counters of completed runs, and the
    /// last recorded counters of runs that died).
    pub lost_claims: i64,
    /// Every work run.
    pub runs: Vec<WorkRun>,
    /// Work runs that exited normally.
    pub completed_runs: usize,
    /// Work runs never completed: processes that died.
    pub worker_deaths: i64,
    /// The attempt journal.
    pub journal: JournalFindings,
    /// Journaled runs that died without a journaled death while their process lived on (it
    /// completed its run): reruns no death explains.
    pub superseded_while_alive: usize,
    /// Sends repeated within one attempt (same event, same claim).
    pub sent_twice_in_one_attempt: i64,
    /// Sends repeated by a later attempt, after a counted failure or death or an uncounted
    /// release (expected: the design never claims exactly-once delivery).
    pub sends_redelivered: i64,
    /// Poison events seeded.
    pub poison: i64,
    /// Poison events `failed` with a `LastError` that says their worker died.
    pub poison_failed: i64,
    /// Later events of poison records that are not `processed`.
    pub poison_successors_unprocessed: i64,
}

/// Adds the integrity checks to `checks`.
pub async fn check_integrity(
    sink: &MailSink,
    events: &[EventRow],
    checks: &mut Vec<Check>,
) -> Result<Integrity> {
    let mut out = Integrity::default();
    let runs = sink.work_runs().await?;
    let lived: HashMap<i64, bool> = runs.iter().map(|r| (r.pid, r.completed)).collect();
    let mut lost_before_dying = 0;
    for r in &runs {
        out.lost_claims += r.lost_claims;
        if r.completed {
            out.completed_runs += 1;
        } else {
            out.worker_deaths += 1;
            lost_before_dying += r.lost_claims;
        }
    }
    check(
        checks,
        "no claim lost by a live process",
        out.lost_claims == 0,
        format!(
            "{} claims lost: {} by the {} processes that exited normally, {lost_before_dying} recorded before they died by the {} that died",
            out.lost_claims,
            out.lost_claims - lost_before_dying,
            out.completed_runs,
            out.worker_deaths
        ),
    );

    out.journal = journal::analyse(&sink.journal_entries().await?);
    out.superseded_while_alive = out
        .journal
        .superseded
        .iter()
        .filter(|s| !s.death_before_reclaim && lived.get(&s.pid) == Some(&true))
        .count();
    // One attempt is one claim: an event given back uncounted after its handler ran (its
    // outcome could not be written) runs again at the same `RetryCount` under a new claim,
    // a redelivery like any other, absorbed by the idempotency key.
    let mut per_attempt: HashMap<(String, i32, String), i64> = HashMap::new();
    let mut attempts_per_key: HashMap<String, i64> = HashMap::new();
    for send in sink.sends().await? {
        let n = per_attempt
            .entry((send.key.clone(), send.retry_count, send.claim.clone()))
            .or_default();
        *n += 1;
        if *n == 1 {
            *attempts_per_key.entry(send.key).or_default() += 1;
        }
    }
    out.sent_twice_in_one_attempt = per_attempt.values().map(|n| n - 1).sum();
    out.sends_redelivered = attempts_per_key.values().map(|n| n - 1).sum();
    let j = &out.journal;
    check(
        checks,
        "no handler ran twice for one attempt",
        j.ran_twice == 0 && out.superseded_while_alive == 0 && out.sent_twice_in_one_attempt == 0,
        format!(
            "{} journaled runs of slow and poison handlers: {} went on after another run of their event began, {} died and were run again ({} with their death journaled first, {} while their process lived on); {} sends repeated within one attempt, {} redelivered by a later attempt after a counted failure, a death or an uncounted release",
            j.runs,
            j.ran_twice,
            j.superseded.len(),
            j.superseded
                .iter()
                .filter(|s| s.death_before_reclaim)
                .count(),
            out.superseded_while_alive,
            out.sent_twice_in_one_attempt,
            out.sends_redelivered
        ),
    );
    check_poison(events, &mut out, checks);
    out.runs = runs;
    Ok(out)
}

/// "Poison events ended failed, their records' later events processed".
fn check_poison(events: &[EventRow], out: &mut Integrity, checks: &mut Vec<Check>) {
    let poison: Vec<&EventRow> = events.iter().filter(|e| is_poison(&e.payload)).collect();
    out.poison = poison.len() as i64;
    out.poison_failed = poison
        .iter()
        .filter(|e| {
            e.status == "failed"
                && e.last_error
                    .as_deref()
                    .is_some_and(|m| m.starts_with(WORKER_DIED))
        })
        .count() as i64;
    let later: Vec<&EventRow> = events
        .iter()
        .filter(|e| {
            poison.iter().any(|p| {
                p.record_key.is_some()
                    && e.record_key == p.record_key
                    && (e.created, e.id) > (p.created, p.id)
            })
        })
        .collect();
    out.poison_successors_unprocessed =
        later.iter().filter(|e| e.status != "processed").count() as i64;
    let detail = if poison.is_empty() {
        "no poison events seeded".to_string()
    } else {
        format!(
            "{} poison events: {} failed with LastError \"{WORKER_DIED} …\" after {} poison deaths journaled; {} later events of their records, {} not processed",
            out.poison,
            out.poison_failed,
            out.journal.poison_deaths,
            later.len(),
            out.poison_successors_unprocessed
        )
    };
    check(
        checks,
        "poison events ended failed, their records' later events processed",
        out.poison_failed == out.poison && out.poison_successors_unprocessed == 0,
        detail,
    );
}
