//! Verification of the demo's invariants, read from the database (never from logs), so that
//! `outbox-demo verify` can check any run, including several `outbox-demo work` processes.

use std::collections::{BTreeMap, HashMap};

use anyhow::Result;
use chrono::{DateTime, Utc};
use outbox_persistence::{Database, with_conn};
use serde::Serialize;
use uuid::Uuid;

use super::handlers::{INJECTED_ATTEMPT_TAG, WELCOME_EFFECT, WELCOME_HANDLER_ID};
use super::integrity::check_integrity;
pub use super::journal::Superseded;
use super::sink::MailSink;
use super::workload::{
    ACCOUNT_UPDATED, FEED_TYPES, LEAD_CONVERTED, LEAD_UPDATED, RECORD_TOUCHED, WELCOME_EMAIL,
};

/// One invariant and whether it held.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// The invariant.
    pub name: &'static str,
    /// Whether it held.
    pub ok: bool,
    /// What was measured.
    pub detail: String,
}

/// Everything verification read.
#[derive(Debug, Clone, Serialize)]
pub struct Verification {
    /// Each invariant.
    pub checks: Vec<Check>,
    /// Rows by status.
    pub processed: i64,
    /// Failed rows.
    pub failed: i64,
    /// Rows not yet terminal.
    pub non_terminal: i64,
    /// Sum of `RetryCount`: every failed attempt, counted once.
    pub retries: i64,
    /// Opportunities created.
    pub opportunities: i64,
    /// Emails the provider received (one per idempotency key).
    pub emails: i64,
    /// Duplicate sends the provider absorbed by its idempotency key.
    pub duplicate_sends_absorbed: i64,
    /// Counted failures (rows of the retry audit) by cause.
    pub failures_by_cause: BTreeMap<&'static str, i64>,
    /// Claims lost by processes while they lived (must be 0).
    pub lost_claims: i64,
    /// Every work process's run, with its counters (the last it recorded, when it died).
    pub work_runs: Vec<super::journal::WorkRun>,
    /// Journaled handler runs that went on after another run of their event began, or died
    /// while their process lived on (must be 0).
    pub ran_twice: i64,
    /// Sends repeated within one attempt (must be 0).
    pub sent_twice_in_one_attempt: i64,
    /// Sends repeated by a later attempt after a counted failure or death (expected).
    pub sends_redelivered: i64,
    /// Repeated sends whose earlier send's process died before its attempt committed.
    pub sends_repeated_after_a_death: i64,
    /// Repeated sends whose earlier send's process lived on (expected: none).
    pub sends_repeated_by_a_live_process: i64,
    /// Kills aimed between a held send and its commit, and those repeated with the same key.
    pub kills_after_a_send: i64,
    pub kills_after_a_send_repeated: i64,
    /// Stale reclaims that counted a dead attempt (retry-audit rows whose `LastError` says
    /// the worker died).
    pub reclaims: i64,
    /// Work processes that died (their run was never completed).
    pub worker_deaths: i64,
    /// Poison events seeded.
    pub poison: i64,
    /// Poison events `failed` with a `LastError` that says their worker died.
    pub poison_failed: i64,
    /// Processes a poison event aborted (journaled).
    pub poison_deaths: usize,
    /// Their process ids.
    pub poisoned_pids: std::collections::BTreeSet<i64>,
    /// Journaled runs of slow and poison handlers.
    pub journaled_runs: usize,
    /// Journaled runs that died with their process and were run again: the fault suite, which
    /// journals each of its kills, checks that each one's death came before the rerun.
    pub superseded: Vec<Superseded>,
}

impl Verification {
    /// Whether every invariant held.
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.ok)
    }
}

/// One outbox row, as verification reads it (payload included).
pub use outbox_persistence::test_support::inspect::StoredRow as EventRow;

type Row = EventRow;

/// `(Id, CapturedName, CapturedIndustry, CapturedRevision)` of a demo account.
type AccountRow = (String, Option<String>, Option<String>, Option<i64>);

async fn load_events(db: &Database) -> Result<Vec<Row>> {
    Ok(outbox_persistence::test_support::inspect::all_rows(db).await?)
}

/// Adds one invariant to `checks`.
pub fn check(checks: &mut Vec<Check>, name: &'static str, ok: bool, detail: String) {
    checks.push(Check { name, ok, detail });
}

/// Reads every invariant of the demo from `db` and the provider inbox `sink`.
pub async fn verify(db: &Database, sink: &MailSink) -> Result<Verification> {
    // The change feed (seeded with `--relay` or `--webhooks`), its webhook deliveries and the
    // foreign writers' rows (`outbox-demo foreign`) have no effect of the demo's: every check of
    // effects reads the demo's own events, the terminal count reads all.
    let (feed, events): (Vec<Row>, Vec<Row>) = load_events(db).await?.into_iter().partition(|e| {
        FEED_TYPES.contains(&e.event_type.as_str())
            || e.event_type
                .starts_with(outbox_webhooks::DELIVERY_TYPE_PREFIX)
            || e.event_type == RECORD_TOUCHED
    });
    let by_id: HashMap<String, &Row> = events.iter().map(|e| (e.id.to_string(), e)).collect();
    let count = |status: &str| {
        events
            .iter()
            .chain(&feed)
            .filter(|e| e.status == status)
            .count() as i64
    };
    let (processed, failed) = (count("processed"), count("failed"));
    let non_terminal = count("pending") + count("processing");
    let mut checks = Vec::new();
    check(
        &mut checks,
        "every event terminal",
        non_terminal == 0,
        format!("{processed} processed, {failed} failed, {non_terminal} pending or processing"),
    );
    // Nothing is pruned during a run, and every row ends through the outbox's settles.
    let (tallied, ended) =
        outbox_persistence::test_support::inspect::rollup_against_rows(db).await?;
    check(
        &mut checks,
        "the chart's rollup counts each processed row once",
        tallied == ended,
        format!(
            "{tallied} counted by the throughput rollup, {ended} rows processed (the last 23 hours)"
        ),
    );

    check_effect_log(db, &events, &by_id, &mut checks).await?;
    let opportunities = check_creates(db, &events, &mut checks).await?;
    check_captures(db, &events, &mut checks).await?;
    let (emails, absorbed) = check_deliveries(db, sink, &events, &by_id, &mut checks).await?;

    let retries = outbox_persistence::test_support::inspect::retry_count_sum(db).await?;
    let failures_by_cause = check_retry_audit(db, &events, retries, &mut checks).await?;
    let integrity = check_integrity(sink, &events, &mut checks).await?;
    Ok(Verification {
        checks,
        processed,
        failed,
        non_terminal,
        retries,
        opportunities,
        emails,
        duplicate_sends_absorbed: absorbed,
        reclaims: failures_by_cause
            .get(WORKER_DIED_CAUSE)
            .copied()
            .unwrap_or(0),
        failures_by_cause,
        lost_claims: integrity.lost_claims,
        work_runs: integrity.runs,
        ran_twice: (integrity.journal.ran_twice + integrity.superseded_while_alive) as i64,
        sent_twice_in_one_attempt: integrity.sent_twice_in_one_attempt,
        sends_redelivered: integrity.sends_redelivered,
        sends_repeated_after_a_death: integrity.sends_repeated_after_a_death,
        sends_repeated_by_a_live_process: integrity.sends_repeated_by_a_live_process,
        kills_after_a_send: integrity.kills_after_a_send,
        kills_after_a_send_repeated: integrity.kills_after_a_send_repeated,
        worker_deaths: integrity.worker_deaths,
        poison: integrity.poison,
        poison_failed: integrity.poison_failed,
        poison_deaths: integrity.journal.poison_deaths,
        poisoned_pids: integrity.journal.poisoned_pids.clone(),
        journaled_runs: integrity.journal.runs,
        superseded: integrity.journal.superseded,
    })
}

/// The effect log: one row per processed event, in per-record order.
async fn check_effect_log(
    db: &Database,
    events: &[Row],
    by_id: &HashMap<String, &Row>,
    checks: &mut Vec<Check>,
) -> Result<()> {
    let log: Vec<(i64, String, Option<String>)> = with_conn!(db, |pool| {
        outbox_persistence::statement::query_as(
            "SELECT Seq, EventId, RecordKey FROM DemoEffectLog ORDER BY Seq",
        )
        .fetch_all(pool)
        .await
    })?;
    let mut seen: HashMap<&str, u32> = HashMap::new();
    for (_, event_id, _) in &log {
        *seen.entry(event_id.as_str()).or_default() += 1;
    }
    let twice = seen.values().filter(|n| **n > 1).count();
    let orphans = seen
        .keys()
        .filter(|id| by_id.get(**id).is_none_or(|e| e.status != "processed"))
        .count();
    let missing = events
        .iter()
        .filter(|e| e.status == "processed" && !seen.contains_key(e.id.to_string().as_str()))
        .count();
    check(
        checks,
        "no event processed twice",
        twice == 0 && orphans == 0 && missing == 0,
        format!(
            "{} effect rows; {twice} events with more than one, {orphans} rows of unprocessed events, {missing} processed events without one",
            log.len()
        ),
    );
    let mut last: HashMap<&str, (DateTime<Utc>, Uuid)> = HashMap::new();
    let mut out_of_order = 0;
    for (_, event_id, key) in &log {
        let (Some(key), Some(event)) = (key, by_id.get(event_id.as_str())) else {
            continue;
        };
        let position = (event.created, event.id);
        if let Some(previous) = last.get(key.as_str())
            && *previous > position
        {
            out_of_order += 1;
        }
        last.insert(key.as_str(), position);
    }
    check(
        checks,
        "per-record order held",
        out_of_order == 0,
        format!(
            "{out_of_order} effects ran before an older event of their record ({} records)",
            last.len()
        ),
    );
    Ok(())
}

/// The #3477 create: one opportunity per converted lead, numbered without gaps. Returns the
/// number of opportunities.
async fn check_creates(db: &Database, events: &[Row], checks: &mut Vec<Check>) -> Result<i64> {
    let opportunities: Vec<(String, String, i64)> = with_conn!(db, |pool| {
        outbox_persistence::statement::query_as(
            "SELECT SourceLeadId, Relation, OpportunityNumber FROM DemoOpportunity",
        )
        .fetch_all(pool)
        .await
    })?;
    let mut per_key: HashMap<(&str, &str), u32> = HashMap::new();
    for (lead, relation, _) in &opportunities {
        *per_key.entry((lead, relation)).or_default() += 1;
    }
    let duplicates = per_key.values().filter(|n| **n > 1).count();
    // A lead converted by two application writes (a second `seed` over the same records, as
    // the fault suite runs beside the workers) has one opportunity: its natural key is the
    // lead's.
    let conversions: Vec<&Row> = events
        .iter()
        .filter(|e| e.event_type == LEAD_CONVERTED && e.status == "processed")
        .collect();
    let converted = conversions
        .iter()
        .filter_map(|e| e.record_key.as_deref())
        .collect::<std::collections::HashSet<_>>()
        .len();
    check(
        checks,
        "no duplicate natural-key create",
        duplicates == 0 && opportunities.len() == converted,
        format!(
            "{} opportunities for {converted} converted leads ({} processed conversions); {duplicates} natural keys with more than one",
            opportunities.len(),
            conversions.len()
        ),
    );
    let mut numbers: Vec<i64> = opportunities.iter().map(|o| o.2).collect();
    numbers.sort_unstable();
    let contiguous = numbers.iter().enumerate().all(|(i, n)| *n == i as i64 + 1);
    let next: Option<i64> = with_conn!(db, |pool| {
        outbox_persistence::statement::query_scalar(
            "SELECT NextValue FROM _System_Autonumber WHERE ObjectName = 'demoopportunity' AND FieldName = 'opportunitynumber'",
        )
        .fetch_optional(pool)
        .await
    })?;
    let expected_next = numbers.len() as i64 + 1;
    check(
        checks,
        "no autonumber gap",
        contiguous && next.unwrap_or(1) == expected_next,
        format!(
            "numbers 1..={} contiguous: {contiguous}; next value {} (expected {expected_next})",
            numbers.len(),
            next.map_or("none".into(), |n| n.to_string())
        ),
    );
    Ok(opportunities.len() as i64)
}

/// Field capture: each record's captured fields equal its newest processed snapshot.
/// Each capturing record's newest processed event with its snapshot.
fn newest_snapshots(events: &[Row]) -> Result<HashMap<&str, (&Row, serde_json::Value)>> {
    let mut newest: HashMap<&str, (&Row, serde_json::Value)> = HashMap::new();
    for e in events.iter().filter(|e| e.status == "processed") {
        let captures = matches!(
            e.event_type.as_str(),
            ACCOUNT_UPDATED | LEAD_UPDATED | LEAD_CONVERTED
        );
        let Some(key) = e.record_key.as_deref().filter(|_| captures) else {
            continue;
        };
        if newest
            .get(key)
            .is_some_and(|(n, _)| (n.created, n.id) > (e.created, e.id))
        {
            continue;
        }
        let snapshot = serde_json::from_str::<serde_json::Value>(&e.payload)?["snapshot"].clone();
        newest.insert(key, (e, snapshot));
    }
    Ok(newest)
}

async fn check_captures(db: &Database, events: &[Row], checks: &mut Vec<Check>) -> Result<()> {
    let newest = newest_snapshots(events)?;
    let accounts: Vec<AccountRow> = with_conn!(db, |pool| {
        outbox_persistence::statement::query_as(
            "SELECT Id, CapturedName, CapturedIndustry, CapturedRevision FROM DemoAccount",
        )
        .fetch_all(pool)
        .await
    })?;
    let leads: Vec<(String, Option<String>, Option<i64>)> = with_conn!(db, |pool| {
        outbox_persistence::statement::query_as(
            "SELECT Id, CapturedStatus, CapturedRevision FROM DemoLead",
        )
        .fetch_all(pool)
        .await
    })?;
    let mut wrong = Vec::new();
    for (id, name, industry, revision) in &accounts {
        let key = record_key::RecordKey::new("Account", id)
            .map(record_key::RecordKey::into_string)
            .unwrap_or_default();
        let expected = newest.get(key.as_str()).map(|(_, s)| {
            (
                s["Name"].as_str().map(str::to_string),
                s["Industry"].as_str().map(str::to_string),
                s["Revision"].as_i64(),
            )
        });
        let actual = (name.clone(), industry.clone(), *revision);
        if expected.unwrap_or((None, None, None)) != actual {
            wrong.push(key);
        }
    }
    for (id, status, revision) in &leads {
        let key = record_key::RecordKey::new("Lead", id)
            .map(record_key::RecordKey::into_string)
            .unwrap_or_default();
        let expected = newest.get(key.as_str()).map(|(_, s)| {
            (
                s["Status"].as_str().map(str::to_string),
                s["Revision"].as_i64(),
            )
        });
        if expected.unwrap_or((None, None)) != (status.clone(), *revision) {
            wrong.push(key);
        }
    }
    check(
        checks,
        "captured fields equal the newest processed snapshot",
        wrong.is_empty(),
        format!(
            "{} records checked; {} differ{}",
            accounts.len() + leads.len(),
            wrong.len(),
            if wrong.is_empty() {
                String::new()
            } else {
                format!(" (first: {})", wrong[0])
            }
        ),
    );
    Ok(())
}

/// The external effect: one email per processed welcome event, sent through the library's
/// effect ledger under the key it derives for the event. Returns the emails delivered and the
/// duplicate sends the provider absorbed.
async fn check_deliveries(
    db: &Database,
    sink: &MailSink,
    events: &[Row],
    by_id: &HashMap<String, &Row>,
    checks: &mut Vec<Check>,
) -> Result<(i64, i64)> {
    let deliveries = sink.deliveries().await?;
    // The key each welcome event's send carries, and back.
    let welcome_keys: HashMap<String, &Row> = events
        .iter()
        .filter(|e| e.event_type == WELCOME_EMAIL)
        .map(|e| {
            let key = outbox_persistence::idempotency_key(WELCOME_HANDLER_ID, e.id, WELCOME_EFFECT);
            (key, e)
        })
        .collect();
    let processed_welcome: Vec<&String> = welcome_keys
        .iter()
        .filter(|(_, e)| e.status == "processed")
        .map(|(k, _)| k)
        .collect();
    let not_sent = processed_welcome
        .iter()
        .filter(|k| !deliveries.contains_key(k.as_str()))
        .count();
    let strangers = deliveries
        .keys()
        .filter(|k| {
            welcome_keys.get(k.as_str()).is_none_or(|e| {
                by_id.get(e.id.to_string().as_str()).is_none() || e.status == "pending"
            })
        })
        .count();
    let absorbed: i64 = deliveries.values().map(|n| n - 1).sum();
    let ledger: Vec<String> = with_conn!(db, |pool| {
        outbox_persistence::statement::query_scalar(
            "SELECT IdempotencyKey FROM _System_OutboxEffect WHERE HandlerId = $1",
        )
        .bind(WELCOME_HANDLER_ID)
        .fetch_all(pool)
        .await
    })?;
    // Every processed welcome event's send is in the ledger, and every send the ledger holds
    // reached the provider (a failed attempt's send is kept too).
    let unledgered = processed_welcome
        .iter()
        .filter(|k| !ledger.contains(k))
        .count();
    let ledger_undelivered = ledger
        .iter()
        .filter(|k| !deliveries.contains_key(k.as_str()))
        .count();
    check(
        checks,
        "each external delivery sent once per processed event",
        not_sent == 0 && strangers == 0 && unledgered == 0 && ledger_undelivered == 0,
        format!(
            "{} emails for {} processed welcome events; {not_sent} missing, {strangers} unexpected; effect ledger rows {} ({unledgered} processed events missing, {ledger_undelivered} never delivered); {absorbed} duplicate sends absorbed by the idempotency key",
            deliveries.len(),
            processed_welcome.len(),
            ledger.len()
        ),
    );
    Ok((deliveries.len() as i64, absorbed))
}

/// The cause of a counted dead attempt (a stale reclaim).
const WORKER_DIED_CAUSE: &str = "worker_died";

/// The cause of a counted failure, from its `LastError`.
fn cause(error: Option<&str>) -> &'static str {
    let error = error.unwrap_or_default();
    // First: a dead attempt's LastError may quote the error of an earlier attempt.
    if error.starts_with(outbox_persistence::WORKER_DIED) {
        WORKER_DIED_CAUSE
    } else if error.contains("injected") {
        "injected"
    } else if error.contains("lock timeout") {
        "lock_timeout"
    } else if error.contains("unavailable") {
        "connection_lost"
    } else if error.is_empty() {
        "no_error_recorded"
    } else {
        "other"
    }
}

/// "Every failure counted once in `RetryCount`", from the retry audit the trigger writes in
/// the transaction of each count: every change is +1 (or an operator's reset to 0); each
/// event's counts since its last reset are 1..=RetryCount, each exactly once, each with the
/// error that caused it; and an injected failure, which names its attempt, is the count of
/// that attempt (a failure counted twice would show up as a later count naming an earlier
/// attempt). Returns the counted failures by cause.
async fn check_retry_audit(
    db: &Database,
    events: &[Row],
    retries: i64,
    checks: &mut Vec<Check>,
) -> Result<BTreeMap<&'static str, i64>> {
    let audit: Vec<(String, i32, i32, Option<String>)> =
        outbox_persistence::test_support::inspect::retry_audit(db)
            .await?
            .into_iter()
            .map(|a| {
                (
                    a.event_id,
                    a.old_retry_count,
                    a.new_retry_count,
                    a.last_error,
                )
            })
            .collect();
    let mut by_cause: BTreeMap<&'static str, i64> = BTreeMap::new();
    let mut counts: HashMap<&str, Vec<i32>> = HashMap::new();
    let (mut jumps, mut misattributed) = (0, 0);
    for (event_id, old, new, error) in &audit {
        let list = counts.entry(event_id.as_str()).or_default();
        if *new == 0 {
            list.clear();
            continue;
        }
        if *new != old + 1 {
            jumps += 1;
        }
        list.push(*new);
        let why = cause(error.as_deref());
        *by_cause.entry(why).or_default() += 1;
        let named = error
            .as_deref()
            .filter(|_| why != WORKER_DIED_CAUSE)
            .and_then(|e| e.split_once(INJECTED_ATTEMPT_TAG))
            .and_then(|(_, rest)| {
                rest.split(|c: char| !c.is_ascii_digit())
                    .next()
                    .and_then(|n| n.parse::<i32>().ok())
            });
        if named.is_some_and(|attempt| attempt != *new) {
            misattributed += 1;
        }
    }
    let mut uncounted_or_twice = 0;
    for e in events {
        let final_count = e.retry_count;
        let list = counts.get(e.id.to_string().as_str());
        let expected: Vec<i32> = (1..=final_count).collect();
        if list.map_or(final_count != 0, |l| *l != expected) {
            uncounted_or_twice += 1;
        }
    }
    let counted: i64 = by_cause.values().sum();
    check(
        checks,
        "every failure counted once in RetryCount (retry audit)",
        jumps == 0 && misattributed == 0 && uncounted_or_twice == 0 && counted == retries,
        format!(
            "{counted} counted failures audited for sum(RetryCount) = {retries}; {jumps} counts not +1, {uncounted_or_twice} events whose counts are not exactly 1..=RetryCount, {misattributed} injected failures counted for another attempt; by cause {by_cause:?}"
        ),
    );
    Ok(by_cause)
}
