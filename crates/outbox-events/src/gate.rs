//! The rollout gate: `OUTBOX_PULL_WORKER` may flip only when every live consumer is safe,
//! protected or excluded, and no non-terminal row lacks the `RecordKey` its payload derives.

use std::sync::Arc;

use outbox_persistence::OutboxRepository;
use serde::Serialize;

use crate::consumer::{Consumer, Verdict};

/// The gate's decision and everything behind it.
#[derive(Debug, Clone, Serialize)]
pub struct GateReport {
    /// Every registered consumer with its verdict.
    pub consumers: Vec<(Consumer, Verdict)>,
    /// Non-terminal rows whose `RecordKey` is missing although their payload derives one.
    pub rows_missing_record_key: u64,
    /// One line per reason the flag may not flip; empty when it may.
    pub reasons: Vec<String>,
}

impl GateReport {
    /// Whether `OUTBOX_PULL_WORKER` may flip.
    pub fn passes(&self) -> bool {
        self.reasons.is_empty()
    }

    /// Event types of excluded consumers: they stay on the legacy path in pull mode.
    pub fn excluded_event_types(&self) -> Vec<String> {
        let mut types: Vec<String> = self
            .consumers
            .iter()
            .filter(|(_, v)| *v == Verdict::Excluded)
            .map(|(c, _)| c.event_type.clone())
            .collect();
        types.sort();
        types.dedup();
        types
    }
}

/// How a dispatcher decided what to run: pull workers only when asked for and the gate passes
/// (or was skipped by name), the legacy dispatcher otherwise. Made by
/// [`crate::Dispatcher::decide`]; the fields say why.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ModeDecision {
    /// The mode the workers run.
    pub mode: crate::DispatchMode,
    /// Event types kept on the legacy path in pull mode (the configuration's and the excluded
    /// consumers').
    pub excluded_event_types: Vec<String>,
    /// Why pull mode was refused: empty when it runs or was not asked for.
    pub refused: Vec<String>,
    /// The reason the gate was skipped, when it was.
    pub gate_skipped: Option<String>,
}

/// How long a start waits for the schema's check before it goes on without it.
const SCHEMA_CHECK_FOR: std::time::Duration = std::time::Duration::from_secs(5);

/// Refuses to start on a database that lacks outbox migrations this build needs
/// ([`outbox_persistence::Error::NotMigrated`], which names them and what applies them), as
/// `Database::check_schema` and the `outbox` binary do: every claim would fail, and nothing
/// would say why. A database whose outbox table exists with no outbox migration recorded (a
/// tool of the application's own applied them) passes. Everything else starts, logged: a
/// newer schema (a newer build migrated it: the outbox's migrations keep the previous
/// release's binaries working during a rolling deploy, docs/schema.md), a check that fails (a
/// role that may not read the migrations' table) or does not answer within
/// [`SCHEMA_CHECK_FOR`] (a database away: the gate's reads and the workers ride it out).
async fn schema_ready(repo: &Arc<dyn OutboxRepository>) -> Result<(), outbox_persistence::Error> {
    use outbox_persistence::Error;
    // On a task of its own, left to finish when the wait ends (and a panic in it is caught):
    // the check's transactions always end as they would unbounded. sqlx 0.9.0 returned a
    // transaction dropped while its `BEGIN` waited to the pool still open; the workspace
    // requires 0.9.1, which fixed that, and the task costs nothing.
    let repo = repo.clone();
    let check = tokio::spawn(async move { repo.check_schema().await });
    match tokio::time::timeout(SCHEMA_CHECK_FOR, check).await {
        Ok(Ok(Ok(()))) => Ok(()),
        Ok(Ok(Err(e @ Error::NotMigrated { .. }))) => {
            tracing::error!(error = %e, "the outbox schema lacks this build's migrations: starting nothing");
            Err(e)
        }
        Ok(Ok(Err(e @ Error::SchemaTooNew { .. }))) => {
            tracing::warn!(error = %e, "starting on a schema a newer build migrated (a rolling deploy)");
            Ok(())
        }
        Ok(Ok(Err(e))) => {
            tracing::warn!(error = %e.chain(), "could not read the outbox's applied migrations; starting without checking them");
            Ok(())
        }
        Ok(Err(panicked)) => {
            tracing::warn!(error = %panicked, "the outbox's schema check panicked; starting without it");
            Ok(())
        }
        Err(_) => {
            tracing::warn!(
                "the outbox's applied migrations could not be read in time; starting without checking them"
            );
            Ok(())
        }
    }
}

impl ModeDecision {
    /// Filled in by `start_decided` right after the workers start.
    pub(crate) fn placeholder() -> Self {
        Self {
            mode: crate::DispatchMode::Legacy,
            excluded_event_types: Vec::new(),
            refused: Vec::new(),
            gate_skipped: None,
        }
    }

    /// Decides from the configuration and the registered consumers, logging the decision.
    /// `required`: the caller starts pull workers or nothing (`Dispatcher::start_pull`), so a
    /// refusal falls back to nothing.
    pub(crate) async fn make(
        repo: &Arc<dyn OutboxRepository>,
        consumers: &[Consumer],
        config: &crate::WorkerConfig,
        required: bool,
    ) -> Result<Self, outbox_persistence::Error> {
        schema_ready(repo).await?;
        // A handler registered through the effect ledger fails every event without its table,
        // in whichever mode it runs (the legacy path runs the same handlers): refused before
        // anything starts.
        if consumers
            .iter()
            .any(|c| c.through_ledger() || c.uses_ledger())
            && !repo.effect_ledger_ready().await?
        {
            return Err(outbox_persistence::Error::Unsupported(
                LEDGER_TABLE_MISSING.to_owned(),
            ));
        }
        let mut decision = Self {
            mode: crate::DispatchMode::Legacy,
            excluded_event_types: config.excluded_event_types.clone(),
            refused: Vec::new(),
            gate_skipped: None,
        };
        if config.mode != crate::DispatchMode::Pull {
            tracing::info!(
                "pull workers not asked for ({} is off): running the legacy dispatcher",
                crate::OUTBOX_PULL_WORKER
            );
            return Ok(decision);
        }
        if let Some(why) = &config.rollout_gate_skipped {
            tracing::warn!(why = %why, "ROLLOUT GATE SKIPPED: running pull workers without checking the consumers");
            decision.mode = crate::DispatchMode::Pull;
            decision.gate_skipped = Some(why.clone());
            return Ok(decision);
        }
        let gate = evaluate_gate(repo, consumers).await?;
        if gate.passes() {
            decision.mode = crate::DispatchMode::Pull;
            decision
                .excluded_event_types
                .extend(gate.excluded_event_types());
            decision.excluded_event_types.sort();
            decision.excluded_event_types.dedup();
            tracing::info!(excluded = ?decision.excluded_event_types, "rollout gate passed: running pull workers");
        } else {
            for reason in &gate.reasons {
                tracing::warn!("rollout gate: {reason}");
            }
            if required {
                tracing::error!(
                    reasons = gate.reasons.len(),
                    "pull workers required, but the rollout gate refuses: starting nothing"
                );
            } else {
                tracing::warn!(
                    reasons = gate.reasons.len(),
                    "pull workers asked for, but the rollout gate refuses: running the legacy dispatcher"
                );
            }
            decision.refused = gate.reasons;
        }
        Ok(decision)
    }
}

/// Why a dispatcher with a consumer registered through the effect ledger does not start, and
/// the gate refuses, on a database without the ledger's table.
const LEDGER_TABLE_MISSING: &str = "the effect ledger's table (_System_OutboxEffect) or, on PostgreSQL, its read function (_System_OutboxFindEffects, migration 0024) is missing on this database, and a consumer runs its effects through it: run `outbox migrate`";

/// Evaluates the gate for the registered consumers (`Handlers::consumers`) against the
/// database behind `repo`.
pub async fn evaluate_gate(
    repo: &Arc<dyn OutboxRepository>,
    consumers: &[Consumer],
) -> Result<GateReport, outbox_persistence::Error> {
    let consumers: Vec<(Consumer, Verdict)> = consumers
        .iter()
        .cloned()
        .map(|c| {
            let v = c.verdict();
            (c, v)
        })
        .collect();
    let mut reasons = Vec::new();
    for (consumer, verdict) in &consumers {
        if let Verdict::Blocked(why) = verdict {
            reasons.push(format!(
                "consumer {} of {}: {why}",
                consumer.name, consumer.event_type
            ));
        }
    }
    if consumers
        .iter()
        .any(|(c, _)| c.through_ledger() || c.uses_ledger())
        && !repo.effect_ledger_ready().await?
    {
        reasons.push(LEDGER_TABLE_MISSING.into());
    }
    let missing = repo.count_missing_record_keys().await?;
    if missing > 0 {
        reasons.push(format!(
            "{missing} non-terminal row(s) lack the RecordKey their payload derives: run `outbox backfill-record-keys` or drain them first"
        ));
    }
    Ok(GateReport {
        consumers,
        rows_missing_record_key: missing,
        reasons,
    })
}
