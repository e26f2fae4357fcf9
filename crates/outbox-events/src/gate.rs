//! The rollout gate: `OUTBOX_PULL_WORKER` may flip only when every live consumer is safe,
//! protected or excluded, and no non-terminal row lacks the `RecordKey` its payload derives.

use std::sync::Arc;

use outbox_persistence::OutboxRepository;
use serde::Serialize;

use crate::consumer::{Consumer, Verdict};

/// Rows scanned per page when looking for missing record keys.
const SCAN_BATCH: u32 = 5_000;

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
    let mut missing = 0;
    let mut after = None;
    loop {
        let page = repo.backfill_record_keys(after, SCAN_BATCH, true).await?;
        missing += page.updated;
        after = page.next_after;
        if after.is_none() {
            break;
        }
    }
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
