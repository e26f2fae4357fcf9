//! The heads repair: every [`crate::WorkerConfig::heads_repair`] the dispatcher asks the
//! repository to put the heads table right
//! ([`outbox_persistence::OutboxRepository::repair_heads`]), and logs and counts each key it
//! changed. The claim never depends on a head's position, so a run that fails changes nothing
//! but the order in which records are looked at; see `docs/queries.md`, "Why a head cannot
//! hide a row".

use std::sync::Arc;
use std::time::Duration;

use outbox_persistence::{DEFAULT_HEADS_REPAIR_KEYS, HeadsRepair, OutboxRepository};
use tokio_util::sync::CancellationToken;

use crate::metrics::heads_repaired;

/// Repairs the heads every `every` until `stop`, first one interval after the start.
pub(crate) async fn run(repo: Arc<dyn OutboxRepository>, every: Duration, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        match repo.repair_heads(DEFAULT_HEADS_REPAIR_KEYS).await {
            Ok(report) => log_repair(&report),
            Err(e) => {
                tracing::warn!(error = %e.chain(), "could not repair the heads table; trying again at the next interval")
            }
        }
    }
}

/// Logs each key a repair changed (the key is the record's type and id, no payload) and
/// counts them.
pub(crate) fn log_repair(report: &HeadsRepair) {
    for (repair, keys) in [
        ("misplaced", &report.misplaced),
        ("left over", &report.left_over),
        ("missing", &report.missing),
    ] {
        for key in keys {
            tracing::warn!(record_key = %key, repair, "repaired the head of a record: it named another row than the record's oldest open one, or was left over or missing");
        }
    }
    heads_repaired(report);
}
