//! The demo CRM workload: accounts and leads created and updated (after-save field capture),
//! leads converted (the #3477 related-record create), and welcome emails (an external effect
//! through the library's effect ledger). Several events per record, so per-record order matters.
//!
//! Each application transaction writes its records and enqueues their events together, as the
//! outbox requires.

use anyhow::Result;
use outbox_persistence::{Database, NewEvent, OutboxRepository, with_tx};
use serde_json::json;

use super::handlers::{ABORT_PROCESS, FAIL_FIRST_ATTEMPT};

/// Event types of the demo.
pub const ACCOUNT_UPDATED: &str = "account.updated";
/// A lead's fields changed.
pub const LEAD_UPDATED: &str = "lead.updated";
/// A lead was converted: its opportunity must be created exactly once.
pub const LEAD_CONVERTED: &str = "lead.converted";
/// Send the account's welcome email (external).
pub const WELCOME_EMAIL: &str = "account.welcome_email";
/// A slow report: its handler sleeps `SleepMs` with a live heartbeat (seeded only on request,
/// for the fault suite's "a slow handler is never reclaimed" check).
pub const SLOW_REPORT: &str = "report.slow";

/// A row written by other code beside the workers (`outbox-demo foreign`, the fault suite's
/// foreign writers): its handler does nothing; it exists to put out-of-order rows on the
/// demo's records. No check of effects reads it.
pub const RECORD_TOUCHED: &str = "record.touched";

/// The change feed's event types (seeded with `--relay` or `--webhooks` only): every
/// application write also enqueues, in its transaction, its record's change for the NATS relay
/// to publish or the webhooks to deliver.
pub const ACCOUNT_CHANGED: &str = "account.changed";
/// A lead's change, for the relay or the webhooks.
pub const LEAD_CHANGED: &str = "lead.changed";
/// The event types the demo's relay (or webhooks) owns; the demo's own handlers never claim
/// them.
pub const FEED_TYPES: [&str; 2] = [ACCOUNT_CHANGED, LEAD_CHANGED];

/// Slow events to seed among the workload.
#[derive(Debug, Clone, Copy, Default)]
pub struct SlowEvents {
    /// How many.
    pub count: usize,
    /// How long each handler sleeps, in milliseconds.
    pub sleep_ms: u64,
}

/// What to seed.
#[derive(Debug, Clone, Copy, Default)]
pub struct Workload {
    /// Ordinary events to enqueue.
    pub events: usize,
    /// Records they are about.
    pub records: usize,
    /// Share of events marked to fail their first attempt.
    pub fault_rate: f64,
    /// Varies the workload between runs on one database.
    pub seed: u64,
    /// Slow events to add.
    pub slow: SlowEvents,
    /// Welcome emails whose attempt waits after the send (`sleep_ms`) before it commits.
    pub held: SlowEvents,
    /// Poison records to add (see [`poison_writes`]).
    pub poison: usize,
    /// Whether each write also enqueues its change-feed event ([`FEED_TYPES`]).
    pub feed: bool,
}

/// Events written per application transaction while seeding.
const SEED_BATCH: usize = 200;

/// A small deterministic generator (SplitMix64): the same seed gives the same workload.
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// A draw in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// One application write: the record's new state and its event.
struct Write {
    record: RecordWrite,
    event: NewEvent,
}

enum RecordWrite {
    Account {
        id: String,
        name: String,
        industry: String,
        revision: i64,
    },
    Lead {
        id: String,
        company: String,
        status: String,
        revision: i64,
    },
}

const INDUSTRIES: &[&str] = &["Retail", "Energy", "Banking", "Media", "Health"];
const LEAD_STATUSES: &[&str] = &["Open", "Working", "Nurturing", "Qualified"];

fn record_id(record: usize) -> (bool, String) {
    if record.is_multiple_of(2) {
        (true, format!("A{record:06}"))
    } else {
        (false, format!("L{record:06}"))
    }
}

/// Builds `events` events over `records` records. `fault_rate` marks that share of events to
/// fail their first attempt (a fault any `outbox-demo work` process will inject).
fn generate(events: usize, records: usize, fault_rate: f64, seed: u64) -> Vec<Write> {
    let records = records.max(1);
    let mut rng = Rng::new(seed);
    let mut revisions = vec![0_i64; records];
    let mut welcomed = vec![false; records];
    let mut converted = vec![false; records];
    let mut out = Vec::with_capacity(events);
    for _ in 0..events {
        let r = rng.below(records);
        let (is_account, id) = record_id(r);
        revisions[r] += 1;
        let revision = revisions[r];
        let fault = (rng.unit() < fault_rate).then_some(FAIL_FIRST_ATTEMPT);
        let envelope = |snapshot: serde_json::Value| {
            let mut payload = json!({"object": if is_account {"Account"} else {"Lead"}, "record_id": id, "snapshot": snapshot});
            if let Some(f) = fault {
                payload["demo_fault"] = json!(f);
            }
            payload.to_string()
        };
        out.push(if is_account {
            account_write(&mut rng, r, &id, revision, &mut welcomed[r], &envelope)
        } else {
            lead_write(&mut rng, r, &id, revision, &mut converted[r], &envelope)
        });
    }
    out
}

/// The next write of account `r`: its first event is a welcome email for every fourth
/// account, the others capture its fields.
fn account_write(
    rng: &mut Rng,
    r: usize,
    id: &str,
    revision: i64,
    welcomed: &mut bool,
    envelope: &dyn Fn(serde_json::Value) -> String,
) -> Write {
    let name = format!("Account {r} rev {revision}");
    let industry = INDUSTRIES[rng.below(INDUSTRIES.len())].to_string();
    let welcome = !*welcomed && r.is_multiple_of(4);
    let event = if welcome {
        *welcomed = true;
        NewEvent::new(
            WELCOME_EMAIL,
            envelope(
                json!({"Email": format!("owner{r}@example.test"), "Name": name, "Revision": revision}),
            ),
        )
    } else {
        NewEvent::new(
            ACCOUNT_UPDATED,
            envelope(json!({"Name": name, "Industry": industry, "Revision": revision})),
        )
    };
    Write {
        record: RecordWrite::Account {
            id: id.to_string(),
            name,
            industry,
            revision,
        },
        event,
    }
}

/// The next write of lead `r`: every fourth lead is converted once it reached revision 3 (the
/// #3477 create), the other events capture its status.
fn lead_write(
    rng: &mut Rng,
    r: usize,
    id: &str,
    revision: i64,
    converted: &mut bool,
    envelope: &dyn Fn(serde_json::Value) -> String,
) -> Write {
    let company = format!("Prospect {r}");
    let status = LEAD_STATUSES[rng.below(LEAD_STATUSES.len())].to_string();
    let convert = !*converted && revision >= 3 && r % 4 == 1;
    let event = if convert {
        *converted = true;
        NewEvent::new(
            LEAD_CONVERTED,
            envelope(json!({"Company": company, "Status": "Converted", "Revision": revision})),
        )
    } else {
        NewEvent::new(
            LEAD_UPDATED,
            envelope(json!({"Company": company, "Status": status, "Revision": revision})),
        )
    };
    let status = if convert {
        "Converted".to_string()
    } else {
        status
    };
    Write {
        record: RecordWrite::Lead {
            id: id.to_string(),
            company,
            status,
            revision,
        },
        event,
    }
}

/// The `n`th poison record, `Account:P…`: its older event is a poison `account.updated`
/// (marked `"demo_fault": "abort_process"`: its handler aborts the process on every attempt)
/// and its younger one an ordinary update, which must run once the poison event has failed.
fn poison_writes(n: usize) -> [Write; 2] {
    let id = format!("P{n:06}");
    let write = |revision: i64, fault: Option<&str>| {
        let name = format!("Poison account {n} rev {revision}");
        let mut payload = json!({"object": "Account", "record_id": id, "snapshot":
            {"Name": name, "Industry": "Chemicals", "Revision": revision}});
        if let Some(f) = fault {
            payload["demo_fault"] = json!(f);
        }
        Write {
            record: RecordWrite::Account {
                id: id.clone(),
                name,
                industry: "Chemicals".into(),
                revision,
            },
            event: NewEvent::new(ACCOUNT_UPDATED, payload.to_string()),
        }
    };
    [write(1, Some(ABORT_PROCESS)), write(2, None)]
}

/// What seeding wrote.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Seeded {
    /// Events enqueued.
    pub events: usize,
    /// Records they are about.
    pub records: usize,
    /// Events marked to fail their first attempt.
    pub marked_faults: usize,
    /// Poison events (each with a younger event of its record).
    pub poison: usize,
    /// Change-feed events (one per write when [`Workload::feed`]).
    pub feed: usize,
}

/// Writes the workload: each batch of records and their events in one application
/// transaction. The poison records come first, so their events are the oldest.
pub async fn seed(
    db: &Database,
    repo: &std::sync::Arc<dyn OutboxRepository>,
    w: &Workload,
) -> Result<Seeded> {
    super::schema::ensure(db).await?;
    let slow = w.slow;
    let mut writes: Vec<Write> = (0..w.poison).flat_map(poison_writes).collect();
    writes.extend(generate(w.events, w.records, w.fault_rate, w.seed));
    let marked_faults = writes
        .iter()
        .filter(|w| w.event.payload.contains(FAIL_FIRST_ATTEMPT))
        .count();
    // The slow events and the held sends, interleaved.
    let mut extra: Vec<NewEvent> = Vec::with_capacity(slow.count + w.held.count);
    for n in 0..slow.count.max(w.held.count) {
        if n < slow.count {
            extra.push(slow_event(n, slow.sleep_ms));
        }
        if n < w.held.count {
            extra.push(held_send(n, w.held.sleep_ms));
        }
    }
    let extras = extra.len();
    let mut extra = extra.into_iter();
    let batches = writes.len().div_ceil(SEED_BATCH).max(1);
    for (index, batch) in writes.chunks(SEED_BATCH).enumerate() {
        let mut tx = repo.begin().await?;
        for write in batch {
            write_record(&mut tx, &write.record).await?;
        }
        let mut new_events: Vec<NewEvent> = batch
            .iter()
            .flat_map(|write| events_of(write, w.feed))
            .collect();
        // Spread the slow events and held sends evenly over the batches, so they run while
        // the rest flows.
        let due = extras * (index + 1) / batches - extras * index / batches;
        new_events.extend(extra.by_ref().take(due));
        repo.enqueue(&mut tx, &new_events).await?;
        tx.commit().await?;
    }
    let rest: Vec<NewEvent> = extra.collect();
    if !rest.is_empty() {
        let mut tx = repo.begin().await?;
        repo.enqueue(&mut tx, &rest).await?;
        tx.commit().await?;
    }
    Ok(Seeded {
        events: writes.len() + extras + if w.feed { writes.len() } else { 0 },
        records: if w.events == 0 {
            0
        } else {
            w.records.max(1).min(w.events)
        } + w.poison
            + w.held.count,
        marked_faults,
        poison: w.poison,
        feed: if w.feed { writes.len() } else { 0 },
    })
}

/// A write's events: its own, then (with `feed`) its record's change for the relay or the
/// webhooks, with the
/// same record and so the same `RecordKey`.
fn events_of(write: &Write, feed: bool) -> Vec<NewEvent> {
    let mut events = vec![write.event.clone()];
    if feed {
        let feed_type = match write.record {
            RecordWrite::Account { .. } => ACCOUNT_CHANGED,
            RecordWrite::Lead { .. } => LEAD_CHANGED,
        };
        events.push(NewEvent::new(feed_type, write.event.payload.clone()));
    }
    events
}

/// The `n`th slow event: a report record of its own, whose handler sleeps `sleep_ms`.
fn slow_event(n: usize, sleep_ms: u64) -> NewEvent {
    NewEvent::new(
        SLOW_REPORT,
        json!({"object": "Report", "record_id": format!("R{n:06}"), "snapshot": {"SleepMs": sleep_ms}})
            .to_string(),
    )
}

/// The `n`th held send: a welcome email on an account of its own (`H…`, no account row:
/// the handler needs only the snapshot's `Email`) whose attempt waits `hold_ms` after the
/// send before it commits.
fn held_send(n: usize, hold_ms: u64) -> NewEvent {
    NewEvent::new(
        WELCOME_EMAIL,
        json!({
            "object": "Account",
            "record_id": format!("H{n:06}"),
            "snapshot": {
                "Email": format!("held{n}@example.com"),
                "HoldAfterSendMs": hold_ms, // super::handlers::HOLD_AFTER_SEND_MS
            }
        })
        .to_string(),
    )
}

async fn write_record(tx: &mut outbox_persistence::Tx, record: &RecordWrite) -> Result<()> {
    match record {
        RecordWrite::Account {
            id,
            name,
            industry,
            revision,
        } => {
            with_tx!(tx, |conn| {
                outbox_persistence::statement::query(
                    "INSERT INTO DemoAccount (Id, Name, Industry, Revision) VALUES ($1, $2, $3, $4)
                     ON CONFLICT (Id) DO UPDATE SET Name = excluded.Name,
                       Industry = excluded.Industry, Revision = excluded.Revision",
                )
                .bind(id)
                .bind(name)
                .bind(industry)
                .bind(revision)
                .execute(conn)
                .await
                .map(|_| ())
            })?;
        }
        RecordWrite::Lead {
            id,
            company,
            status,
            revision,
        } => {
            with_tx!(tx, |conn| {
                outbox_persistence::statement::query(
                    "INSERT INTO DemoLead (Id, Company, Status, Revision) VALUES ($1, $2, $3, $4)
                     ON CONFLICT (Id) DO UPDATE SET Company = excluded.Company,
                       Status = excluded.Status, Revision = excluded.Revision",
                )
                .bind(id)
                .bind(company)
                .bind(status)
                .bind(revision)
                .execute(conn)
                .await
                .map(|_| ())
            })?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workload_has_every_effect_class_and_several_events_per_record() {
        let writes = generate(2_000, 200, 0.1, 1);
        let count = |t: &str| writes.iter().filter(|w| w.event.event_type == t).count();
        assert!(count(ACCOUNT_UPDATED) > 500);
        assert!(count(LEAD_UPDATED) > 500);
        assert!(count(LEAD_CONVERTED) > 10);
        assert!(count(WELCOME_EMAIL) > 10);
        let faults = writes
            .iter()
            .filter(|w| w.event.payload.contains(FAIL_FIRST_ATTEMPT))
            .count();
        assert!((100..300).contains(&faults), "{faults}");
        // Deterministic for a seed.
        let again = generate(2_000, 200, 0.1, 1);
        assert!(writes.iter().zip(&again).all(|(a, b)| a.event == b.event));
    }

    #[test]
    fn a_poison_event_comes_before_its_successor_and_is_no_marked_fault() {
        let [poison, successor] = poison_writes(3);
        let key = |w: &Write| record_key::record_key_from_payload(&w.event.payload).unwrap();
        assert_eq!(key(&poison), key(&successor));
        assert_eq!(
            key(&poison)
                .map(record_key::RecordKey::into_string)
                .as_deref(),
            Some("account:P000003")
        );
        assert!(poison.event.payload.contains(ABORT_PROCESS));
        assert!(!successor.event.payload.contains("demo_fault"));
        assert!(!poison.event.payload.contains(FAIL_FIRST_ATTEMPT));
    }
}
