//! The integrity checks of a run with several processes, read from the side store: no claim
//! lost by a process that lived, no handler run twice for one attempt, and poison events ended
//! `failed` with their records' later events run. A process that died (SIGKILL, a poison
//! abort) explains a rerun of what it was doing; nothing else does.

use std::collections::HashMap;

use anyhow::Result;
use outbox_persistence::WORKER_DIED;
use serde::Serialize;

use super::handlers::is_poison;
use super::handlers::{WELCOME_EFFECT, WELCOME_HANDLER_ID};
use super::journal::{self, Entry, JournalFindings, Mark, WorkRun};
use super::sink::{MailSink, Send};
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
    /// Sends followed by another send of the same key whose process died (the attempt died
    /// between its send and its commit, so the ledger never got the send).
    pub sends_repeated_after_a_death: i64,
    /// Sends followed by another send of the same key whose process lived on: the ledger
    /// lost a send it should have kept (expected: none).
    pub sends_repeated_by_a_live_process: i64,
    /// Kills the fault suite aimed between a held send and its commit (journaled `killed` with
    /// the event), and of those, the ones whose send the receiver then got again with the
    /// same key from a later attempt.
    pub kills_after_a_send: i64,
    pub kills_after_a_send_repeated: i64,
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

    let entries = sink.journal_entries().await?;
    out.journal = journal::analyse(&entries);
    out.superseded_while_alive = out
        .journal
        .superseded
        .iter()
        .filter(|s| !s.death_before_reclaim && lived.get(&s.pid) == Some(&true))
        .count();
    let sends = sink.sends().await?;
    count_sends(&sends, &mut out);
    repeated_sends(&sends, &lived, &mut out);
    kills_after_a_send(&entries, &sends, &mut out);
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
    check_repeats(&out, checks);
    check_poison(events, &mut out, checks);
    out.runs = runs;
    Ok(out)
}

/// "Repeated sends equal the attempts that died between send and commit".
fn check_repeats(out: &Integrity, checks: &mut Vec<Check>) {
    check(
        checks,
        "repeated sends equal the attempts that died between send and commit",
        out.sends_repeated_by_a_live_process == 0
            && out.sends_repeated_after_a_death == out.sends_redelivered
            && out.kills_after_a_send_repeated == out.kills_after_a_send,
        format!(
            "{} sends repeated by a later attempt (same key): {} after their sender's process died before its attempt committed, {} while it lived on; {} kills aimed between a held send and its commit, {} of them repeated by a later attempt with the same key",
            out.sends_redelivered,
            out.sends_repeated_after_a_death,
            out.sends_repeated_by_a_live_process,
            out.kills_after_a_send,
            out.kills_after_a_send_repeated
        ),
    );
}

/// Counts the sends repeated within one attempt and by later attempts. One attempt is one
/// claim: an event given back uncounted after its handler ran (its outcome could not be
/// written) runs again at the same `RetryCount` under a new claim, a redelivery like any other,
/// absorbed by the idempotency key.
fn count_sends(sends: &[Send], out: &mut Integrity) {
    let mut per_attempt: HashMap<(&str, i32, &str), i64> = HashMap::new();
    let mut attempts_per_key: HashMap<&str, i64> = HashMap::new();
    for send in sends {
        let n = per_attempt
            .entry((&send.key, send.retry_count, &send.claim))
            .or_default();
        *n += 1;
        if *n == 1 {
            *attempts_per_key.entry(&send.key).or_default() += 1;
        }
    }
    out.sent_twice_in_one_attempt = per_attempt.values().map(|n| n - 1).sum();
    out.sends_redelivered = attempts_per_key.values().map(|n| n - 1).sum();
}

/// Counts the sends that another send of their key followed (read from the provider's own
/// log, in order), by whether their process died. With the effect ledger, a send is repeated
/// only when its attempt neither committed nor recorded it on the side: its process died
/// between the send and the commit (docs/state-machine.md, "The effect ledger").
fn repeated_sends(sends: &[Send], lived: &HashMap<i64, bool>, out: &mut Integrity) {
    let mut last: HashMap<&str, usize> = HashMap::new();
    for (i, send) in sends.iter().enumerate() {
        last.insert(send.key.as_str(), i);
    }
    for (i, send) in sends.iter().enumerate() {
        if last.get(send.key.as_str()) == Some(&i) {
            continue;
        }
        if lived.get(&send.pid) == Some(&true) {
            out.sends_repeated_by_a_live_process += 1;
        } else {
            out.sends_repeated_after_a_death += 1;
        }
    }
}

/// The kills aimed between a held send and its commit (journaled `killed` with the event and
/// the `RetryCount` of the attempt that sent): each must show in the receiver's log as that
/// process's send at that count, followed by a send of the same key from a later attempt.
fn kills_after_a_send(entries: &[Entry], sends: &[Send], out: &mut Integrity) {
    for kill in entries
        .iter()
        .filter(|e| e.mark == Mark::Killed && !e.event_id.is_empty())
    {
        out.kills_after_a_send += 1;
        let Ok(id) = uuid::Uuid::parse_str(&kill.event_id) else {
            continue;
        };
        let key = outbox_persistence::idempotency_key(WELCOME_HANDLER_ID, id, WELCOME_EFFECT);
        let sent_at = sends
            .iter()
            .position(|s| s.key == key && s.pid == kill.pid && s.retry_count == kill.retry_count);
        if let Some(at) = sent_at
            && sends[at + 1..]
                .iter()
                .any(|s| s.key == key && s.retry_count > kill.retry_count)
        {
            out.kills_after_a_send_repeated += 1;
        }
    }
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
