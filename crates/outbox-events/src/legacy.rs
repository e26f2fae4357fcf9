//! The legacy dispatcher the pull workers replace, kept as the flag-off path and as the
//! benchmark baseline: fetch a batch, hash records into slots (`slotForEvent`), run the slots
//! concurrently (each slot in order), and wait for the whole batch before fetching the next.
//! One slow record stalls every other record until its batch ends: the barrier #3477 removes.

use std::sync::Arc;

use outbox_persistence::{OutboxEvent, Scope};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::attempt;
use crate::env::AttemptEnv;
use crate::waits::{back_off, idle, policy};

/// The slot of an event: a stable hash of its `RecordKey` (of its `Id` when it has none), so
/// a record's events of one batch run in order in one slot.
pub fn slot_for_event(event: &OutboxEvent, slots: usize) -> usize {
    let key = match &event.record_key {
        Some(key) => key.as_str().to_owned(),
        None => event.id.to_string(),
    };
    // FNV-1a: stable across processes and releases, unlike std's randomised hasher.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in key.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    (hash % slots.max(1) as u64) as usize
}

pub(crate) async fn run(env: Arc<AttemptEnv>, stop: CancellationToken, scope: Scope) {
    let slots = env.config.workers.max(1);
    let mut idle_wait = std::time::Duration::from_millis(10);
    let mut error_backoff = std::time::Duration::from_millis(100);
    while !stop.is_cancelled() {
        let scope = env.paused.narrow(&scope, &stop).await;
        let since = env.repo.wake_mark();
        let batch = match env
            .repo
            .get_pending_events(policy(&env), &scope, env.config.legacy_batch_size)
            .await
        {
            Ok(batch) => batch,
            Err(e) => {
                tracing::warn!(error = %e.chain(), "fetching a batch failed; backing off");
                back_off(&stop, &mut error_backoff).await;
                continue;
            }
        };
        error_backoff = std::time::Duration::from_millis(100);
        if batch.is_empty() {
            idle(&env, &stop, since, idle_wait).await;
            idle_wait = (idle_wait * 2).min(env.config.poll_interval);
            continue;
        }
        idle_wait = std::time::Duration::from_millis(10);
        let mut by_slot: Vec<Vec<OutboxEvent>> = vec![Vec::new(); slots];
        for event in batch {
            by_slot[slot_for_event(&event, slots)].push(event);
        }
        let mut running = JoinSet::new();
        for events in by_slot.into_iter().filter(|s| !s.is_empty()) {
            let env = env.clone();
            running.spawn(async move {
                for event in events {
                    // One of the dispatcher's attempt permits from the claim to the attempt's
                    // end (shared with the pull workers when both run).
                    let Ok(_permit) = env.attempts.acquire().await else {
                        return;
                    };
                    // A type paused since the fetch is not claimed (its record's later rows
                    // then wait: the claim by id keeps the record's order).
                    if env.paused.is_paused(&event.event_type) {
                        continue;
                    }
                    // The legacy path claims each fetched row by id before running it.
                    match env.repo.claim_event(event.id, policy(&env)).await {
                        Ok(Some(claim)) => {
                            attempt::run(&env, claim).await;
                        }
                        Ok(None) => {}
                        Err(e) => {
                            tracing::warn!(event_id = %event.id, error = %e.chain(), "claim failed");
                        }
                    }
                }
            });
        }
        // The barrier: the next batch waits for the slowest slot of this one.
        while running.join_next().await.is_some() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;
    use outbox_persistence::EventStatus;

    fn event(key: Option<&str>) -> OutboxEvent {
        OutboxEvent {
            id: outbox_persistence::new_event_id(),
            event_type: "t".into(),
            payload: "{}".into(),
            status: EventStatus::Pending,
            retry_count: 0,
            record_key: key.map(outbox_persistence::RecordKey::from_stored),
            created_date: Utc::now(),
            last_modified_date: Utc::now(),
            last_error: None,
        }
    }

    #[test]
    fn a_record_always_maps_to_one_slot() {
        let a = slot_for_event(&event(Some("Lead:1")), 8);
        for _ in 0..10 {
            assert_eq!(slot_for_event(&event(Some("Lead:1")), 8), a);
        }
        let spread: std::collections::HashSet<_> = (0..100)
            .map(|i| slot_for_event(&event(Some(&format!("Lead:{i}"))), 8))
            .collect();
        assert_eq!(spread.len(), 8, "keys spread over every slot");
    }
}
