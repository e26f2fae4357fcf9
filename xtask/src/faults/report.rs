//! The fault suite's report: the invariants `outbox-demo verify --json` read from the database, the
//! suite's own checks on top of them (what only the suite knows: which processes it killed,
//! which exited normally, which ran with its clock behind), the measures, and the markdown.

use std::fmt::Write as _;
use std::time::Duration;

use serde_json::Value;

use super::app::{APP_EVENTS, AppWrites};
use super::chaos::Chaos;
use super::profile::{Backend, CLAIM_LOST_LOG, HEARTBEAT_MS, MAX_RETRY_ATTEMPTS};
use super::skew::{SKEW_SECONDS, Skew};
use super::steps::Step;
use super::suite::{Suite, SuiteReport};
use crate::cmd::format_duration;

/// One invariant: its name, whether it held, what was measured.
type Invariant = (String, bool, String);

/// The sum of a counter over the JSON reports of processes that exited normally.
fn sum<'a>(reports: impl Iterator<Item = &'a Value>, key: &str) -> u64 {
    reports
        .map(|r| r["metrics"][key].as_u64().unwrap_or(0))
        .sum()
}

/// The invariants `outbox-demo verify --json` checked.
fn verified(verification: &Value) -> Vec<Invariant> {
    let Some(list) = verification["checks"].as_array() else {
        return vec![(
            "outbox-demo verify --json".into(),
            false,
            verification.to_string(),
        )];
    };
    list.iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap_or("?").to_string(),
                c["ok"].as_bool().unwrap_or(false),
                c["detail"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

impl Suite<'_> {
    /// The run's report.
    pub(super) fn report(
        &self,
        chaos: &Chaos,
        verification: &Value,
        processing: i64,
        drain_time: Duration,
        total: Duration,
    ) -> SuiteReport {
        let mut checks = verified(verification);
        checks.push((
            "no row left processing".into(),
            processing == 0,
            format!("{processing} rows in processing after the drain"),
        ));
        self.integrity_checks(chaos, verification, &mut checks);
        self.process_checks(chaos, &mut checks);
        let rows = self.measures(chaos, verification, drain_time, total);
        let passed = checks.iter().all(|c| c.1);
        let mut md = String::new();
        let _ = writeln!(
            md,
            "### Fault suite on {}{} ({} profile): {}\n",
            self.backend.name(),
            if self.pooled() {
                " through PgBouncer (transaction pooling)"
            } else {
                ""
            },
            self.profile.name,
            if passed { "PASSED" } else { "FAILED" }
        );
        let _ = writeln!(md, "| measure | value |\n|---|---|");
        for (k, v) in &rows {
            let _ = writeln!(md, "| {k} | {v} |");
        }
        let _ = writeln!(md, "\n| invariant | result | measured |\n|---|---|---|");
        for (name, ok, detail) in &checks {
            let _ = writeln!(
                md,
                "| {name} | {} | {} |",
                if *ok { "ok" } else { "**FAIL**" },
                detail.replace('|', "/")
            );
        }
        if !passed {
            md.push_str(&self.lost_claim_logs());
        }
        let _ = writeln!(md, "\nLogs of each work process: `{}`", self.dir.display());
        let failed = checks
            .iter()
            .filter(|c| !c.1)
            .map(|(name, _, detail)| format!("{name}: {detail}"))
            .collect();
        SuiteReport {
            markdown: md,
            passed,
            failed,
        }
    }

    /// The work processes' log lines that report a lost claim, each with the lines logged
    /// before it: what a failed run needs to find the window (empty when none lost a claim).
    fn lost_claim_logs(&self) -> String {
        /// Lines quoted before each lost claim, and claims quoted per run.
        const BEFORE: usize = 12;
        const CLAIMS: usize = 5;
        let mut files: Vec<_> = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "err"))
            .collect();
        files.sort();
        let mut md = String::new();
        let mut quoted = 0;
        for path in files {
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            let lines: Vec<&str> = text.lines().collect();
            for (at, line) in lines.iter().enumerate() {
                if !line.contains(CLAIM_LOST_LOG) || quoted == CLAIMS {
                    continue;
                }
                quoted += 1;
                let name = path.file_name().unwrap_or_default().to_string_lossy();
                let _ = writeln!(md, "\nA lost claim in `{name}`, line {}:\n```", at + 1);
                for l in &lines[at.saturating_sub(BEFORE)..=at] {
                    let _ = writeln!(md, "{l}");
                }
                let _ = writeln!(md, "```");
            }
        }
        md
    }

    /// Lost claims, reruns, repeated sends and the poison events: what a live process must
    /// never cause, and what a dead one must leave behind.
    fn integrity_checks(&self, chaos: &Chaos, v: &Value, checks: &mut Vec<Invariant>) {
        let reports = || chaos.process_reports.iter();
        let lost = sum(reports(), "lost_claims");
        checks.push((
            "0 lost claims by a live process".into(),
            lost == 0 && v["lost_claims"].as_i64() == Some(0),
            format!(
                "{lost} lost claims reported by the {} processes that exited normally; {} by all runs in the side store (including what processes that died later had recorded)",
                chaos.process_reports.len(),
                v["lost_claims"]
            ),
        ));
        if let Skew::Ready(_) = self.skew {
            // From the runs in the side store: a skewed process that a poison event aborted
            // still left the counters it last recorded.
            let runs = v["work_runs"].as_array().cloned().unwrap_or_default();
            let skewed: Vec<&Value> = runs
                .iter()
                .filter(|r| {
                    r["pid"]
                        .as_u64()
                        .is_some_and(|pid| chaos.skewed_pids.contains(&(pid as u32)))
                })
                .collect();
            let total =
                |key: &str| -> i64 { skewed.iter().map(|r| r[key].as_i64().unwrap_or(0)).sum() };
            let (claimed, lost) = (total("claimed"), total("lost_claims"));
            // A skewed process that the poison event aborted on its first claim recorded no
            // counters (seed 60: the first died at once, its replacement waited for SQLite's
            // lock until the chaos ended): the journal still shows that it claimed and ran it.
            let died_in = v["poisoned_pids"].as_array().map_or(0, |pids| {
                pids.iter()
                    .filter(|p| {
                        p.as_u64()
                            .is_some_and(|pid| chaos.skewed_pids.contains(&(pid as u32)))
                    })
                    .count()
            });
            checks.push((
                format!("a worker whose clock runs {SKEW_SECONDS} s behind loses no claim"),
                (claimed > 0 || died_in > 0) && lost == 0,
                format!(
                    "{} skewed process(es), {} exited normally (the others were aborted by the poison event; their last recorded counters count): {claimed} claims, {lost} lost, {} stale reclaims; {died_in} aborted by the poison event it claimed",
                    skewed.len(),
                    skewed.iter().filter(|r| r["completed"] == true).count(),
                    total("stale_reclaims")
                ),
            ));
        }
        let twice = v["sent_twice_in_one_attempt"].as_i64();
        checks.push((
            "0 sends repeated within one attempt".into(),
            twice == Some(0),
            format!(
                "{} sends repeated within one attempt; {} redelivered by a later attempt after a counted failure, a death or an uncounted release; {} duplicates absorbed by the idempotency key",
                v["sent_twice_in_one_attempt"],
                v["sends_redelivered"],
                v["duplicate_sends_absorbed"]
            ),
        ));
        checks.push(slow_handler_check(v));
        let (poison, failed) = (v["poison"].as_i64(), v["poison_failed"].as_i64());
        checks.push((
            "the poison events ended failed".into(),
            poison.is_some_and(|n| n > 0) && failed == poison,
            format!(
                "{} poison event(s), {} failed with LastError \"worker died: …\", after {} processes aborted on it (MaxRetryAttempts {MAX_RETRY_ATTEMPTS})",
                v["poison"], v["poison_failed"], chaos.poison_deaths
            ),
        ));
    }

    /// No crash, and every fault injected.
    fn process_checks(&self, chaos: &Chaos, checks: &mut Vec<Invariant>) {
        checks.push((
            "no worker process crashed".into(),
            chaos.crashed.is_empty(),
            if chaos.crashed.is_empty() {
                format!(
                    "{} processes started, {} killed by the suite, {} aborted by the poison event (SIGABRT after its log line, replaced), {} refused to start because their database was cut or restarting while they started (exit 1 with the error before their workers started, replaced), {} stopped by the end-of-chaos SIGINT while still starting, the rest exited 0",
                    chaos.spawned,
                    chaos.kills.len(),
                    chaos.poison_deaths,
                    chaos.startup_cuts,
                    chaos.stopped_while_starting
                )
            } else {
                chaos.crashed.join("; ")
            },
        ));
        let mut coverage = format!(
            "{} SIGKILLs ({} between a held send and its commit), {} poison aborts",
            chaos.kills.len(),
            chaos.kills_after_a_send,
            chaos.poison_deaths
        );
        write!(coverage, ", {} foreign rows", chaos.foreign_rows).ok();
        let mut covered =
            !chaos.kills.is_empty() && chaos.poison_deaths > 0 && chaos.foreign_rows > 0;
        if let Skew::Ready(_) = self.skew {
            write!(coverage, ", {} skewed process(es)", chaos.skewed_pids.len()).ok();
            covered &= !chaos.skewed_pids.is_empty();
        }
        if self.backend == Backend::Postgres {
            let lost_replies = self.reply_loss.as_ref().map_or(0, |p| p.counts().2);
            let step_cuts: u64 = chaos.step_cuts.iter().sum();
            write!(
                coverage,
                ", {} connections cut ({step_cuts} at a step of an attempt), {} restart(s), {} outside lock holds on accounts and {} on claimed rows, {lost_replies} COMMIT replies lost",
                chaos.connections_cut,
                chaos.restarts.len(),
                chaos.lock_holds,
                chaos.claimed_holds
            )
            .ok();
            covered &= chaos.connections_cut > 0
                && step_cuts > 0
                && chaos.restarts.len() == 1
                && chaos.lock_holds > 0
                && chaos.claimed_holds > 0
                && lost_replies > 0;
        }
        if self.backend == Backend::Postgres {
            write!(
                coverage,
                ", {} application transactions",
                chaos.app.committed
            )
            .ok();
            covered &= chaos.app.committed > 0;
        }
        checks.push(("every fault was injected".into(), covered, coverage));
        if self.backend == Backend::Postgres {
            checks.push(app_check(&chaos.app));
        }
    }

    /// The measures table.
    fn measures(
        &self,
        chaos: &Chaos,
        v: &Value,
        drain_time: Duration,
        total: Duration,
    ) -> Vec<(&'static str, String)> {
        let mut rows = self.run_measures(chaos, v, drain_time, total);
        rows.extend(self.fault_measures(chaos, v));
        rows.extend(self.outcome_measures(chaos, v));
        rows
    }

    /// What ran: the events, the processes, the time.
    fn run_measures(
        &self,
        chaos: &Chaos,
        v: &Value,
        drain_time: Duration,
        total: Duration,
    ) -> Vec<(&'static str, String)> {
        let p = self.profile;
        let events = format!(
            "{} ({} processed, {} failed) over {} records, {} of them slow ({} ms), {} poison",
            p.events + p.slow_events + 2 * p.poison_events,
            v["processed"],
            v["failed"],
            p.records + p.poison_events,
            p.slow_events,
            p.slow_ms,
            p.poison_events
        );
        let workers = format!(
            "{} `outbox-demo work` processes of {} workers at a time{}; {} started in all",
            p.processes,
            p.workers,
            match self.skew {
                Skew::Ready(_) => format!(", one with its clock {SKEW_SECONDS} s behind"),
                Skew::Unavailable(_) => String::new(),
            },
            chaos.spawned
        );
        let time = format!(
            "{} of chaos, {} from the first worker to drained; {} in all",
            format_duration(chaos.chaos_time),
            format_duration(drain_time),
            format_duration(total)
        );
        vec![("events", events), ("workers", workers), ("time", time)]
    }

    /// The faults injected: deaths, cuts, restarts, lock holds.
    fn fault_measures(&self, chaos: &Chaos, v: &Value) -> Vec<(&'static str, String)> {
        let cause = |name: &str| v["failures_by_cause"][name].as_i64().unwrap_or(0);
        let mut rows: Vec<(&'static str, String)> = vec![
            (
                "worker deaths",
                format!(
                    "{} = {} SIGKILLs + {} poison aborts; {} dead attempts counted on reclaim",
                    chaos.kills.len() + chaos.poison_deaths,
                    chaos.kills.len(),
                    chaos.poison_deaths,
                    cause("worker_died")
                ),
            ),
            (
                "foreign writers (plain inserts, older CreatedDate, sleeps in their transactions)",
                chaos
                    .foreign
                    .clone()
                    .unwrap_or_else(|| "no summary (see foreign.out)".into()),
            ),
        ];
        if self.backend == Backend::Postgres {
            rows.push((
                "connections cut (pg_terminate_backend)",
                format!("{} in {} rounds", chaos.connections_cut, chaos.cut_rounds),
            ));
            rows.push((
                "PostgreSQL restarts",
                chaos
                    .restarts
                    .iter()
                    .map(|d| format!("1 (back after {})", format_duration(*d)))
                    .collect::<Vec<_>>()
                    .join(", "),
            ));
            rows.push((
                "outside row-lock holds (psql)",
                format!(
                    "{} on demo accounts (the handlers' writes), {} on claimed outbox rows (the settles' and beats' writes)",
                    chaos.lock_holds, chaos.claimed_holds
                ),
            ));
            let steps: Vec<String> = Step::ALL
                .iter()
                .enumerate()
                .map(|(i, step)| {
                    format!(
                        "{} {} of {}",
                        step.name(),
                        chaos.step_cuts[i],
                        chaos.step_rounds[i]
                    )
                })
                .collect();
            rows.push((
                "cuts at a step of an attempt (cut of rounds tried)",
                steps.join(", "),
            ));
            if let Some(proxy) = &self.reply_loss {
                let (connections, commits, lost) = proxy.counts();
                rows.push((
                    "COMMIT replies lost (every other chaos process through the proxy)",
                    format!(
                        "{lost} of {commits} COMMITs (one in {}) over {connections} connections",
                        proxy.one_in
                    ),
                ));
            }
        } else {
            rows.push((
                "not applicable on SQLite",
                "connection cuts, server restart, outside row locks (the work processes' own lock holder takes SQLite's write lock)".into(),
            ));
        }
        rows.push((
            "lock timeouts hit (counted failures)",
            cause("lock_timeout").to_string(),
        ));
        rows
    }

    /// What the faults caused: retries, reclaims, what the processes saw, the external sends.
    fn outcome_measures(&self, chaos: &Chaos, v: &Value) -> Vec<(&'static str, String)> {
        let cause = |name: &str| v["failures_by_cause"][name].as_i64().unwrap_or(0);
        let mut rows: Vec<(&'static str, String)> = Vec::new();
        let mut add = |k: &'static str, v: String| rows.push((k, v));
        add(
            "retries (sum of RetryCount)",
            format!(
                "{} = {} injected handler faults + {} lock timeouts + {} lost connections + {} dead attempts (worker died) + {} other",
                v["retries"],
                cause("injected"),
                cause("lock_timeout"),
                cause("connection_lost"),
                cause("worker_died"),
                cause("other") + cause("no_error_recorded")
            ),
        );
        add("kill to reclaim", self.reclaim_text(chaos));
        let reports = || chaos.process_reports.iter();
        add(
            "seen by the processes that exited normally",
            format!(
                "{} claims, {} stale reclaims, {} lost claims, {} detached bookkeeping, {} batched attempts, {} claims given back unrun",
                sum(reports(), "claimed"),
                sum(reports(), "stale_reclaims"),
                sum(reports(), "lost_claims"),
                sum(reports(), "detached_bookkeeping"),
                sum(reports(), "batches"),
                sum(reports(), "not_run")
            ),
        );
        if let Skew::Unavailable(why) = self.skew {
            add("skewed-clock process", format!("skipped: {why}"));
        }
        add(
            "external sends (welcome emails)",
            format!(
                "{} delivered; {} redelivered by a later attempt ({} after their sender died between send and commit, {} while it lived on), {} repeated within one attempt; {} kills aimed between a held send and its commit, {} of them repeated with the same key; {} duplicates absorbed by the provider's idempotency key",
                v["emails"],
                v["sends_redelivered"],
                v["sends_repeated_after_a_death"],
                v["sends_repeated_by_a_live_process"],
                v["sent_twice_in_one_attempt"],
                v["kills_after_a_send"],
                v["kills_after_a_send_repeated"],
                v["duplicate_sends_absorbed"]
            ),
        );
        rows
    }

    /// Kill-to-reclaim times of the rows the killed processes held.
    fn reclaim_text(&self, chaos: &Chaos) -> String {
        let mut reclaim = chaos.reclaim_ms.clone();
        reclaim.sort_unstable();
        if reclaim.is_empty() {
            return "n/a (no killed process held a row)".to_string();
        }
        format!(
            "p50 {} ms, max {} ms over {} rows (stale-after {} ms, heartbeat {} ms)",
            reclaim[reclaim.len() / 2],
            reclaim[reclaim.len() - 1],
            reclaim.len(),
            self.stale_after_ms(),
            HEARTBEAT_MS
        )
    }
}

/// "A slow handler with a live heartbeat is never reclaimed", from the journal's analysis: a
/// run superseded before its process's death was journaled is quoted with its journal.
fn slow_handler_check(v: &Value) -> Invariant {
    let superseded = v["superseded"].as_array().cloned().unwrap_or_default();
    let early = superseded
        .iter()
        .filter(|s| s["death_before_reclaim"] != true)
        .count();
    (
        "a slow handler with a live heartbeat is never reclaimed".into(),
        early == 0 && v["ran_twice"].as_i64() == Some(0),
        format!(
            "{} journaled runs, {} ran again while running; {} reclaimed after their process's death was journaled (SIGKILL or poison abort), {early} before it{}",
            v["journaled_runs"],
            v["ran_twice"],
            superseded.len() - early,
            superseded
                .iter()
                .filter(|s| s["death_before_reclaim"] != true)
                .map(|s| format!(
                    " (event {} run by pid {} at RetryCount {}; journal: {})",
                    s["event_id"].as_str().unwrap_or("?"),
                    s["pid"],
                    s["retry_count"],
                    s["journal"]
                ))
                .collect::<String>()
        ),
    )
}

/// "The application's transactions never fail because of the workers".
fn app_check(app: &AppWrites) -> Invariant {
    (
        "the application's transactions never fail because of the workers".into(),
        app.failed.is_empty(),
        format!(
            "{} application transactions of {APP_EVENTS} events (upserting the accounts and leads the handlers write) committed beside the workers, {} failed with a lock conflict{}, {} lost their connection to the restart",
            app.committed,
            app.failed.len(),
            app.failed
                .first()
                .map_or(String::new(), |e| format!(" (first: {e})")),
            app.cut_by_restart
        ),
    )
}
